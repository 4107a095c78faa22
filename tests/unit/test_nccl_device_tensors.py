"""Under NCCL (two or more GPUs) a collective on the default group takes device tensors only, and pickled objects go
over the gloo group beside it (megarl.distributed.object_group). A CPU machine cannot run NCCL, so these tests
stand in a world of two ranks under NCCL: the runtime's device is declared 'meta' (no tensor reaches it by accident)
and a checker takes the place of torch.distributed's collectives. It raises on a tensor off that device passed with
the device group and on an object collective anywhere but the gloo group, then records the call. The call sites run
through it: the weight sync's metrics, the rollout broadcast of a step (from steps.py), verify under torchrun."""
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from megarl import distributed, runtime
from megarl.megatron import parallel

GLOO = SimpleNamespace(name="the gloo object group")


class HostDataOnDeviceGroup(AssertionError):
    """A host tensor, or a pickled object, handed to a collective of the NCCL group."""


class _Reached(Exception):
    """Stops a receiving rank after its first collective (meta tensors hold no values to read on)."""


def _group(args, kwargs, position):
    return kwargs["group"] if "group" in kwargs else (args[position] if len(args) > position else None)


@pytest.fixture
def nccl(monkeypatch):
    """A world of two under NCCL; returns (state, calls): state["rank"] is this rank, calls the checked collectives."""
    state, calls = {"rank": 0}, []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: state["rank"])
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo" if group is GLOO else "nccl")
    monkeypatch.setattr(distributed, "object_group", lambda: GLOO)

    def tensors(name, group_at, src_at=None):
        def collective(*args, **kwargs):
            group = _group(args, kwargs, group_at)
            flat = [t for a in args for t in (a if isinstance(a, list) else [a]) if isinstance(t, torch.Tensor)]
            if group is not GLOO:
                host = [t for t in flat if t.device != distributed.compute_device()]
                if host:
                    raise HostDataOnDeviceGroup(f"{name}: a {tuple(host[0].shape)} tensor on {host[0].device} "
                                                f"with the NCCL group")
            calls.append((name, "gloo" if group is GLOO else "nccl", {t.device.type for t in flat}))
            src = kwargs.get("src", args[src_at] if src_at is not None and len(args) > src_at else None)
            if src is not None and src != state["rank"]:
                raise _Reached(name)
        return collective

    def objects(name, group_at, fill):
        def collective(*args, **kwargs):
            group = _group(args, kwargs, group_at)
            if group is not GLOO:
                raise HostDataOnDeviceGroup(f"{name}: a pickled object with the NCCL group")
            calls.append((name, "gloo", None))
            fill(*args)
        return collective

    def gather_fill(out, obj, *rest):
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "broadcast", tensors("broadcast", 2, src_at=1))
    monkeypatch.setattr(dist, "all_gather", tensors("all_gather", 2))
    monkeypatch.setattr(dist, "all_reduce", tensors("all_reduce", 2))
    monkeypatch.setattr(dist, "all_gather_object", objects("all_gather_object", 2, gather_fill))
    monkeypatch.setattr(dist, "broadcast_object_list", objects("broadcast_object_list", 2, lambda *a: None))
    distributed.declare_device("meta")
    yield state, calls
    distributed.declare_device(None)


def test_the_checker_rejects_host_tensors_and_objects_on_the_nccl_group(nccl):
    with pytest.raises(HostDataOnDeviceGroup, match=r"broadcast: a \(3,\) tensor on cpu with the NCCL group"):
        dist.broadcast(torch.zeros(3), src=0)
    with pytest.raises(HostDataOnDeviceGroup, match="all_gather_object: a pickled object with the NCCL group"):
        dist.all_gather_object([None, None], {"a": 1})
    dist.broadcast(torch.zeros(3, device="meta"), src=0)
    dist.broadcast(torch.zeros(3), src=0, group=GLOO)  # host tensors may travel over gloo
    assert nccl[1] == [("broadcast", "nccl", {"meta"}), ("broadcast", "gloo", {"cpu"})]


def test_weight_sync_metrics_travel_as_objects_over_gloo(nccl):
    from megarl.sync.transports.colocated import WeightSync

    sync = SimpleNamespace(buckets=[[], [], []], plan_sent={0: 8.0, 1: 4.0}, plan_received={1: 8.0},
                           plan_loaded={0: 12.0})
    stats = {"sent": 8, "received": 2, "loaded": 12, "placed": 5, "exchange_s": 0.5, "load_s": 0.25}
    out = WeightSync._metrics(sync, stats, 2.0)
    assert nccl[1] == [("all_gather_object", "gloo", None)]
    # both ranks report these figures (the checker's gather): sums over two ranks, maxima and rank 0's as given
    assert out["weight_sync/bytes"] == 24.0 and out["weight_sync/placed_bytes"] == 10.0
    assert out["weight_sync/sent_bytes_max"] == 8.0 and out["weight_sync/received_bytes_rank0"] == 2.0
    assert out["weight_sync/gbps"] == 24.0 / 2.0 / 1e9 and out["weight_sync/num_buckets"] == 3.0


def _rollout():
    """A batch with every optional field and no two fields alike (a field received into another's place shows)."""
    from megarl.types import RolloutBatch

    n, width = 2, 3
    return RolloutBatch(prompt_ids=[[1, 2], [3]], response_ids=torch.arange(10, 16).view(n, width),
                        response_lengths=torch.tensor([3, 1]), rollout_logprobs=-torch.arange(6.0).view(n, width) / 7,
                        finish_reasons=["stop", "length"], truncated=torch.tensor([False, True]),
                        prompt_index=torch.tensor([4, 5]), prompt_truncated=torch.tensor([True, False]),
                        weight_version=7, pad_token_id=9, loss_mask=torch.tensor([[True, False, True], [True] * 3]),
                        tool_rewards=torch.tensor([0.5, -1.0]),
                        routed_experts=torch.arange(40, dtype=torch.int16).view(n, 5, 2, 2),
                        metrics={"rollout/num_samples": 2.0, "rollout/generate_seconds": 1.5})


def _runtime(rank):
    from megarl.layout import EngineTopology

    return runtime.Runtime(rank=rank, world_size=2, dp_rank=rank, dp_size=2, run_dir=Path("."),
                           engines=EngineTopology(2, 1, 1))


def test_the_step_rollout_broadcast_sends_every_field_from_the_device(nccl):
    from megarl.rollout.protocol import Deferred
    from megarl.steps import finish_generate

    batch = _rollout()
    assert finish_generate([Deferred.ready(batch)], _runtime(0)) is batch
    # the header, then response ids, logprobs, the per-row codes, prompt lengths, prompt ids, loss mask, tool
    # rewards, routed experts and metrics: 10 broadcasts, each of a device tensor on the NCCL group
    assert nccl[1] == [("broadcast", "nccl", {"meta"})] * 10


def test_the_step_rollout_broadcast_receives_into_the_device(nccl):
    from megarl.steps import finish_generate

    state, calls = nccl
    state["rank"] = 1
    with pytest.raises(_Reached):
        finish_generate([None], _runtime(1))
    assert calls == [("broadcast", "nccl", {"meta"})]


def test_verify_under_torchrun_gathers_results_and_the_verdict_over_gloo(nccl, tmp_path, monkeypatch):
    from megarl import verify
    from megarl.megatron.precision import TF32_ENV
    from tests.helpers.tiny_models import make_tiny_model

    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv(TF32_ENV, "0")  # main sets it; restored after the test
    monkeypatch.setattr(distributed, "init_distributed", lambda *a, **k: None)
    mine = {"megatron": torch.zeros(2, 3), "tf32": False}
    monkeypatch.setattr(verify, "megatron_logprobs", lambda **kwargs: mine)
    judged = []
    monkeypatch.setattr(verify, "_judge", lambda args, gathered, *rest: judged.append(gathered) or 3)
    assert verify.main(["--hf", str(hf_dir), "--batch", "2", "--seq-len", "4"]) == 3
    assert judged == [[mine, mine]]
    assert nccl[1] == [("all_gather_object", "gloo", None), ("broadcast_object_list", "gloo", None)]


def test_the_object_group_is_gloo_beside_nccl_and_none_under_gloo(tmp_path, monkeypatch):
    if dist.is_initialized():
        pytest.skip("this process already holds a torch.distributed world")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        assert distributed.object_group() is None  # under gloo the default group carries objects itself
        real = dist.get_backend
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl" if group is None else real(group))
        group = distributed.object_group()
        assert group is not None and real(group) == "gloo" and distributed.object_group() is group
    finally:
        parallel.destroy()
    assert distributed._object_group is None
