"""The transfer group that delivers weights to engines in processes of their own (megarl.sync.transports.remote),
without vLLM: trainer ranks with a real megatron model send their pieces to engine host processes, whose stand-in engine
assembles what each worker's bucket files hold. Every worker must end with exactly its shard of every HF tensor as
the checkpoint on disk has it (shards as vLLM lays them out at the engine's TP, predicted from the model's shapes),
and the bytes each trainer rank sent and each host received must equal the plan's; with data-parallel copies both
ranks send, neither the whole model.
"""
import multiprocessing as mp
import os
import time

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model, read_checkpoint


class AssemblingEngine:
    """Stands in for VLLMEngine on the host: reads each worker's bucket files as megarl's worker extension does, and
    with verify compares what it holds after the update with what the files gave it, as the extension reads back a
    worker's memory (True: every tensor; a list: those HF names)."""

    def __init__(self, layouts, fail_at=None, die_at=None, corrupt_at=None):
        self.layouts = layouts
        self.version = 0
        self.fail_at = fail_at  # (sync, bucket): raise there, as a worker failing to load would
        self.die_at = die_at  # (sync, bucket): the process dies there, as a crashed engine host would
        self.corrupt_at = corrupt_at  # (sync, hf name): one element of worker 0's copy flipped after it loaded
        self.loads = 0

    def begin_update(self, verify=False):
        self.got = [{} for _ in self.layouts]
        self.sums = [{} for _ in self.layouts] if verify else None
        self.sample = None if isinstance(verify, bool) else set(verify)
        self.loads = self.loaded = 0

    def load_bucket(self, metas):
        from megarl.sync.wire import open_bucket, region

        self.loads += 1
        if self.fail_at and (self.version + 1, self.loads) == self.fail_at:
            raise RuntimeError("worker 0 failed to load bucket 2")
        if self.die_at and (self.version + 1, self.loads) == self.die_at:
            os._exit(3)
        for w, meta in enumerate(metas):
            if not meta:
                continue
            buf = open_bucket(meta["path"], int(meta["size"]))
            for name, dtype, shape, offset, _need, boxes in meta["tensors"]:
                full = region(buf, dtype, shape, int(offset))
                into = self.got[w].setdefault(name, torch.full(tuple(shape), float("nan"), dtype=full.dtype))
                for box in boxes:
                    sl = tuple(slice(lo, hi) for lo, hi in box)
                    into[sl] = full[sl]
                    self.loaded += into[sl].numel() * into.element_size()
                    if self.sums is not None and (self.sample is None or name in self.sample):
                        self.sums[w][(name, box_key(box))] = full[sl].clone()

    def abort_update(self):
        self.got = None

    def end_update(self):
        self.version += 1
        if self.corrupt_at and self.corrupt_at[0] == self.version:
            t = self.got[0][self.corrupt_at[1]].view(-1)
            t[t.numel() // 2] = -t[t.numel() // 2] + 1  # one element, in what the worker computes with
        metrics = {"weight_sync/version": float(self.version), "weight_sync/engine_bytes": float(self.loaded),
                   "got": self.got}
        if self.sums is not None:
            from megarl.sync.weights import compare_checksums, tensor_checksum

            for w, loaded in enumerate(self.sums):
                held = {f"{n}{b}": tensor_checksum(self.got[w][n][tuple(slice(lo, hi) for lo, hi in b)])
                        for n, b in loaded}
                report = compare_checksums({f"{n}{b}": tensor_checksum(t) for (n, b), t in loaded.items()}, held)
                if not report["ok"]:
                    raise RuntimeError(f"weight sync verification failed at version {self.version} on engine worker "
                                       f"{w}: mismatched {report['mismatched'][:8]}")
            metrics["weight_sync/verified_tensors"] = float(sum(len(x) for x in self.sums))
        return metrics


def box_key(box):
    return tuple(tuple(int(x) for x in side) for side in box)


def _host(conn, layouts, faults):
    from megarl.rollout.hosting.receiver import WeightReceiver

    receiver = WeightReceiver(AssemblingEngine(layouts, **faults))
    while True:
        cmd, *args = conn.recv()
        if cmd == "stop":
            return
        try:
            if cmd == "join":
                receiver.join(*args)
                conn.send(None)
            elif cmd == "leave":
                receiver.leave()
                conn.send(None)
            elif cmd == "plan":
                receiver.plan = args[0]
                conn.send(None)
            else:
                conn.send(receiver.receive(*args))
        except BaseException as exc:  # noqa: BLE001 - the test sees it
            conn.send(exc)


class HostHandle:
    """An engine handle with one host process (the interface RayEngine and EngineProcess give remote.py)."""

    def __init__(self, layouts, **faults):
        self.layouts = layouts
        self._start(faults)

    def _start(self, faults):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_host, args=(child, self.layouts, faults), daemon=True)
        self.proc.start()
        child.close()  # the host's end lives in the host only: its death reads as EOF here

    def restart(self):
        """A fresh host process in place of this one (dead or alive), as a restarted engine: nothing received."""
        self.shutdown()
        self._start({})

    def _ask(self, *msg):
        from megarl.rollout.protocol import Deferred

        self.conn.send(msg)

        def answer():
            out = self.conn.recv()
            if isinstance(out, BaseException):
                raise out
            return out
        return Deferred(answer)

    def transfer_layouts(self):
        return [self.layouts]

    def start_join_transfer(self, spec, first_rank):
        return self._ask("join", spec, first_rank)

    def set_receive_plans(self, plans):
        self._ask("plan", plans[0]).result()

    def leave_transfer(self):
        self._ask("leave").result()

    def start_receive_weights(self, sync, verify=False):
        from megarl.rollout.protocol import Deferred

        call = self._ask("receive", sync, verify)

        def result():
            out = call.result()
            self.got = out["metrics"].pop("got")  # what this host's workers hold
            self.received = out["received"]
            return [out]
        return Deferred(result)

    def shutdown(self):
        if self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()


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
