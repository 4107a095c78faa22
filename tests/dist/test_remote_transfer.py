"""The transfer group that delivers weights to engines in processes of their own (megarl.sync.transports.remote),
without vLLM: trainer ranks with a real megatron model send their pieces to engine host processes, whose stand-in engine
assembles what each worker's bucket files hold. Every worker must end with exactly its shard of every HF tensor as
the checkpoint on disk has it (shards as vLLM lays them out at the engine's TP, predicted from the model's shapes),
and the bytes each trainer rank sent and each host received must equal the plan's; with data-parallel copies both
ranks send, neither the whole model.
"""
import time

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.engine_hosts import HostHandle
from tests.helpers.tiny_models import make_tiny_model, read_checkpoint


def deliver(hf_dir, tp, engine_tp, host_ranks, fail_at=None):
    import torch.distributed as dist

    from megarl.bridge.mapping import Mapping
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.sync.factory import REMOTE, build_sync
    from megarl.sync.shards import predict_engine_modules
    from tests.helpers.sync_builds import counting_sync_builds

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    model, spec = build_and_load(hf_dir)
    mapping = Mapping(spec)
    layouts = [{"modules": {k: v.to_dict() for k, v in predict_engine_modules(mapping, engine_tp, 1, w).items()}}
               for w in range(engine_tp)]
    handle = HostHandle(layouts, fail_at=fail_at) if dist.get_rank() in host_ranks else None
    builds = {"mappings": 0, "holdings": 0}
    with counting_sync_builds(builds):  # small buckets: tensors straddle them and are cut
        sync = build_sync(model, spec, handle, None, 16 << 10, REMOTE)
    out, got = {}, None
    for _ in range(2):  # the second sync reuses the group and the plan
        t0 = time.perf_counter()
        try:
            with counting_sync_builds(builds):
                out = sync.run(handle)
        except Exception as exc:  # noqa: BLE001 - the test checks who saw what, and how fast
            return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    if handle is not None:
        got = handle.got
        handle.shutdown()
    return {"metrics": out, "got": got, "builds": builds}


@pytest.mark.parametrize("tp,engine_tp,host_ranks", [(1, 2, [0]), (2, 1, [0, 1])],
                         ids=["dp2-to-engine-tp2", "tp2-to-two-replicas"])
def test_each_worker_receives_its_shard_from_the_ranks_holding_it(tmp_path, tp, engine_tp, host_ranks):
    from megarl.bridge.hf_config import load_spec
    from megarl.bridge.mapping import Mapping
    from megarl.sync.shards import engine_needs, predict_engine_modules

    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    results = run_ranks(f"{__name__}:deliver", 2, {"hf_dir": str(hf_dir), "tp": tp, "engine_tp": engine_tp,
                                                   "host_ranks": host_ranks}, timeout=300)
    reference = read_checkpoint(hf_dir)
    mapping = Mapping(load_spec(str(hf_dir)))
    model_bytes = sum(t.numel() * t.element_size() for t in reference.values())
    hosts = [r for r in results if r["got"] is not None]
    assert len(hosts) == len(host_ranks)
    for host in hosts:
        assert host["metrics"]["weight_sync/version"] == 2.0
        for w, got in enumerate(host["got"]):
            needs = engine_needs(mapping, predict_engine_modules(mapping, engine_tp, 1, w))
            assert sorted(got) == sorted(needs)
            for name, box in needs.items():
                sl = tuple(slice(lo, hi) for lo, hi in box)
                assert torch.equal(got[name][sl], reference[name][sl]), (w, name)
    for r in results:  # every rank built the mapping and its holdings once, for the plan; both syncs reused them
        assert r["builds"] == {"mappings": 1, "holdings": 1}, r["builds"]
    m = results[0]["metrics"]
    for kind in ("sent", "received", "loaded"):  # what moved is what the plan says
        assert m[f"weight_sync/{kind}_bytes_max"] == m[f"weight_sync/plan_{kind}_bytes_max"] > 0, m
        assert m[f"weight_sync/{kind}_bytes_rank0"] == m[f"weight_sync/plan_{kind}_bytes_rank0"], m
    assert m["weight_sync/received_bytes_rank0"] == 0  # trainer ranks only send
    assert m["weight_sync/senders"] == 2  # both ranks send: DP copies share the work, TP shards each send their own
    assert m["weight_sync/sent_bytes_max"] < model_bytes * len(host_ranks)
    if engine_tp == 1 and tp == 2:  # each TP rank holds about half of each replica's model and sends only that
        assert m["weight_sync/sent_bytes_max"] < 0.75 * model_bytes * len(host_ranks)
    if tp == 1:  # both ranks hold everything: the plan splits the sending between them
        assert m["weight_sync/sent_bytes_max"] < 0.75 * model_bytes


def test_a_host_failing_midway_stops_every_rank_at_once(tmp_path):
    """The host's engine fails on the second bucket of the second sync: the host aborts the update and closes its
    end of the group, so the ranks still sending fail within seconds (not at the group's 30-minute timeout), and
    every rank raises EngineHostLost (the host is in an unknown state: its engine is restarted) with the host's own
    error in it."""
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    results = run_ranks(f"{__name__}:deliver", 2, {"hf_dir": str(hf_dir), "tp": 1, "engine_tp": 1, "host_ranks": [0],
                                                   "fail_at": (2, 2)}, timeout=300)
    assert all(r.get("error", "").startswith("EngineHostLost: weight sync 2: engine host(s) [2]") for r in results), \
        results
    assert all("worker 0 failed to load bucket 2" in r["error"] for r in results), results
    assert max(r["seconds"] for r in results) < 60, results


def _perturb(model, update: int) -> None:
    """Move about 1% of every parameter's elements by 0.01, the same elements on every rank holding the same shapes
    (data-parallel copies stay equal), as an optimizer step in bfloat16 changes few of what the engine holds."""
    gen = torch.Generator().manual_seed(1000 + update)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p[torch.rand(p.shape, generator=gen) < 0.01] += 0.01


def deliver_delta(hf_dir, tp, engine_tp, host_ranks, wire_dtype, full_every, updates):
    """Syncs after updates that change ~1% of the weights, delta updates on: what every host's workers hold after each
    one (as the checkpoint's dtype would reach the engine: cast to the wire dtype), the reference export of the same
    weights, and each sync's metrics."""
    import torch.distributed as dist

    from megarl.bridge.exporter import export_to_dict
    from megarl.bridge.mapping import Mapping
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.sync.factory import REMOTE, build_sync
    from megarl.sync.shards import predict_engine_modules
    from megarl.sync.transports.remote_delta import DeltaSettings

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    model, spec = build_and_load(hf_dir)
    mapping = Mapping(spec)
    layouts = [{"modules": {k: v.to_dict() for k, v in predict_engine_modules(mapping, engine_tp, 1, w).items()}}
               for w in range(engine_tp)]
    handle = HostHandle(layouts) if dist.get_rank() in host_ranks else None
    sync = build_sync(model, spec, handle, None, 16 << 10, REMOTE, engine_dtype=getattr(torch, wire_dtype),
                      delta=DeltaSettings(full_every=full_every))
    rounds = []
    for u in range(updates):
        if u:
            _perturb(model, u)
        metrics = sync.run(handle)
        reference = {k: v.to(getattr(torch, wire_dtype)) for k, v in export_to_dict(model, spec).items()}
        rounds.append({"metrics": metrics, "got": handle.got if handle is not None else None,
                       "reference": reference if handle is not None else None})
    if handle is not None:
        handle.shutdown()
    return rounds


@pytest.mark.parametrize("tp,engine_tp,wire_dtype", [(1, 2, "float32"), (2, 1, "bfloat16")],
                         ids=["dp2-to-engine-tp2-fp32", "tp2-to-engine-tp1-bf16"])
def test_delta_updates_leave_the_engine_exactly_as_full_updates_would(tmp_path, tp, engine_tp, wire_dtype):
    """Delta updates (megarl.sync.delta) after changes to ~1% of the weights: after every update each worker holds
    exactly its shard of the current weights in the wire dtype, bit for bit; updates 1 and 4 are full (the first, then
    every 3), 2 and 3 send the changed elements only: at most 1% x (index + value bytes) / value bytes of the full
    update's bytes plus the pieces sent whole because they are small (bounded at 10% here)."""
    from megarl.bridge.hf_config import load_spec
    from megarl.bridge.mapping import Mapping
    from megarl.sync.shards import engine_needs, predict_engine_modules

    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    rounds_per_rank = run_ranks(f"{__name__}:deliver_delta", 2, {
        "hf_dir": str(hf_dir), "tp": tp, "engine_tp": engine_tp, "host_ranks": [0], "wire_dtype": wire_dtype,
        "full_every": 3, "updates": 4}, timeout=300)
    mapping = Mapping(load_spec(str(hf_dir)))
    rounds = rounds_per_rank[0]
    assert [r["metrics"]["weight_sync/full_update"] for r in rounds] == [1.0, 0.0, 0.0, 1.0]
    for u, r in enumerate(rounds):
        for w, got in enumerate(r["got"]):
            needs = engine_needs(mapping, predict_engine_modules(mapping, engine_tp, 1, w))
            assert sorted(got) == sorted(needs)
            for name, box in needs.items():
                sl = tuple(slice(lo, hi) for lo, hi in box)
                assert got[name].dtype == getattr(torch, wire_dtype)
                assert torch.equal(got[name][sl], r["reference"][name][sl]), (u, w, name)
        m = r["metrics"]
        assert m["weight_sync/checked_pieces"] > 0  # the trainer's and the host's checksums of every piece agreed
        full_bytes = m["weight_sync/plan_sent_bytes_max"]
        if m["weight_sync/full_update"]:
            assert m["weight_sync/sent_bytes_max"] == full_bytes
        else:
            assert 0 < m["weight_sync/changed_elements"]
            assert 0 < m["weight_sync/sent_bytes_max"] < 0.1 * full_bytes, m
