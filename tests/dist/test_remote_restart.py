"""Engine hosts that restart or die while the trainer delivers weights to them (megarl.sync.transports.remote):
two trainer ranks, each driving one engine host (a replica at engine TP1, stand-in engines of
tests/helpers/engine_hosts), bfloat16 delta updates after updates that change ~1% of the weights.

* restart: after three updates rank 1's host is replaced by a fresh process; RemoteSync.rejoin re-forms the transfer
  group with the same plan; the next update goes whole to the new host and as a delta to the survivor, and both end
  bit for bit as a full update would leave them.
* lost: rank 1's host dies in the middle of the third update; both trainer ranks survive it with EngineHostLost
  (naming the host, its owner and its end), the survivor got the whole update; a rejoin without restarting the lost
  engine is refused on both ranks; after a restart and rejoin the next update is whole to the new host, delta to the
  survivor, and both hold the current weights.
* corrupt: one element of what a worker computes with is flipped after it loaded; the read-back check of that update
  (every tensor every 2 updates here) stops it with the tensor's name.
"""
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_remote_transfer import _perturb
from tests.helpers.engine_hosts import HostHandle
from tests.helpers.tiny_models import make_tiny_model


def _holds(handle, reference, needs) -> list:
    """The tensors whose needed box on the host's worker 0 differs from the reference in any bit."""
    got = handle.got[0]
    wrong = []
    for name, box in needs.items():
        sl = tuple(slice(lo, hi) for lo, hi in box)
        if name not in got or not torch.equal(got[name][sl].view(torch.int16), reference[name][sl].view(torch.int16)):
            wrong.append(name)
    return wrong


def restart_hosts(hf_dir, scenario):
    import torch.distributed as dist

    from megarl.bridge.exporter import export_to_dict
    from megarl.bridge.mapping import Mapping
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.sync.factory import REMOTE, build_sync
    from megarl.sync.shards import engine_needs, predict_engine_modules
    from megarl.sync.transports.remote import EngineHostLost
    from megarl.sync.transports.remote_delta import DeltaSettings

    init_model_parallel(Layout(tensor_model_parallel_size=1), seed=0)
    rank = dist.get_rank()
    model, spec = build_and_load(hf_dir)
    mapping = Mapping(spec)
    modules = predict_engine_modules(mapping, 1, 1, 0)
    needs = engine_needs(mapping, modules)
    layouts = [{"modules": {k: v.to_dict() for k, v in modules.items()}}]
    faults = {"lost": {"die_at": (3, 2)}, "corrupt": {"corrupt_at": (2, "model.layers.0.mlp.down_proj.weight")}}
    handle = HostHandle(layouts, **(faults.get(scenario, {}) if rank == 1 else {}))
    settings = DeltaSettings(full_every=100, verify_every=2 if scenario == "corrupt" else 0, verify_sample=0)
    sync = build_sync(model, spec, handle, None, 16 << 10, REMOTE, engine_dtype=torch.bfloat16, delta=settings)
    out = {"rounds": [], "plan_received": {h: sync.plan_received[h] for h in sync.hosts.ranks()}}

    def update(u):
        _perturb(model, u)
        metrics = sync.run(handle)
        reference = {k: v.to(torch.bfloat16) for k, v in export_to_dict(model, spec).items()}
        out["rounds"].append({"metrics": metrics, "received": handle.received,
                              "wrong": _holds(handle, reference, needs)})

    try:
        for u in range(3):
            update(u)
    except EngineHostLost as lost:
        out["lost"] = {"hosts": lost.hosts, "owners": lost.owners, "message": str(lost)}
        reference = {k: v.to(torch.bfloat16) for k, v in export_to_dict(model, spec).items()}  # a collective
        # the survivor received the whole third update before the ranks learned of the loss
        out["survivor_wrong"] = _holds(handle, reference, needs) if rank == 0 else None
    except RuntimeError as exc:
        out["error"] = str(exc)
        handle.shutdown()
        return out
    if scenario == "lost":  # a rejoin before the lost engine was restarted: refused on every rank, none left waiting
        try:
            sync.rejoin(handle, False)
        except RuntimeError as exc:
            out["stale"] = str(exc)
    if scenario in ("restart", "lost"):
        restarted = rank == 1
        if restarted:
            handle.restart()
        sync.rejoin(handle, restarted)
        update(3)
    handle.shutdown()
    return out


def _run(tmp_path, scenario):
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    return run_ranks(f"{__name__}:restart_hosts", 2, {"hf_dir": str(hf_dir), "scenario": scenario}, timeout=300)


def _after_rejoin(results):
    """The update after rejoin: whole to the new host (rank 1's, transfer rank 3), delta to the survivor (rank 0's,
    transfer rank 2), both holding exactly the current weights."""
    last = [r["rounds"][-1] for r in results]
    m = last[0]["metrics"]
    assert m["weight_sync/full_hosts"] == 1.0 and m["weight_sync/full_update"] == 0.0, m
    plan = results[0]["plan_received"]
    assert last[1]["received"] == plan[3]  # every piece whole
    # ~1% of the elements changed: masks or indices, far below the piece sizes (bounded at 10% as for delta updates)
    assert 0 < last[0]["received"] < 0.1 * plan[2], (last[0]["received"], plan[2])
    assert m["weight_sync/checked_pieces"] > 0  # the trainer's kept copies and both mirrors agreed bit for bit
    assert last[0]["wrong"] == [] and last[1]["wrong"] == []


def test_a_restarted_host_gets_a_whole_update_and_the_survivor_a_delta(tmp_path):
    results = _run(tmp_path, "restart")
    assert all("lost" not in r and "error" not in r for r in results), results
    first = results[0]["rounds"]
    assert [r["metrics"]["weight_sync/full_hosts"] for r in first] == [2.0, 0.0, 0.0, 1.0]
    _after_rejoin(results)


def test_a_host_lost_mid_transfer_leaves_the_trainer_ranks_running(tmp_path):
    results = _run(tmp_path, "lost")
    for r in results:  # every rank raised the same EngineHostLost, after the same two updates
        assert r["lost"]["hosts"] == (3,) and r["lost"]["owners"] == (1,), r
        assert "EOFError" in r["lost"]["message"] or "closed" in r["lost"]["message"], r["lost"]["message"]
        assert len(r["rounds"]) == 3  # two before the loss, one after the rejoin
    assert results[0]["survivor_wrong"] == []  # the survivor's update was whole and complete
    assert all("engine host(s) [3] were lost, but the trainer ranks owning them ([1])" in r["stale"] for r in results)
    _after_rejoin(results)


def test_a_corrupted_engine_weight_is_caught_by_the_next_read_back(tmp_path):
    results = _run(tmp_path, "corrupt")
    for r in results:
        assert "error" not in r, r
    lost = [r["lost"] for r in results]
    assert all(x["hosts"] == (3,) for x in lost), lost
    assert all("verification failed at version 2 on engine worker 0" in x["message"]
               and "model.layers.0.mlp.down_proj.weight" in x["message"] for x in lost), lost
