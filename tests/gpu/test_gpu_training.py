"""The GPU training path (run with `make test-gpu` on a machine with a CUDA GPU; skipped elsewhere).

On CUDA the ranks use NCCL, the model lives on the GPU and micro-batches travel there from the CPU batch: these tests
check that path against references computed independently of megatron, as tests/dist/test_actor_step.py does on CPU.
  - the actor update at TP1 in fp32 equals the plain-torch update of the HF model (HF logprobs, megarl.algo's PPO loss,
    torch autograd, torch.optim.Adam);
  - bf16 with fp32 main params: the optimizer steps fp32 copies of bf16 weights, and the update agrees with the
    reference to bf16 precision;
  - megatron's distributed optimizer gives the same update as the plain one;
  - a resumed update (model, optimizer and scheduler saved after step 1 and loaded into a fresh model) equals the
    uninterrupted step 2;
  - bench/bench_train.py reports tokens/s and MFU for a model of at least 1B parameters (its speed targets are the
    benchmark's own lines, not assertions here);
  - the offload round trip through one pinned staging area is bitwise, frees the device memory, and is reused.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_actor_step import CLIP_HIGH, CLIP_LOW, LR, N, setup  # noqa: F401 - setup is a fixture

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True, scope="module")
def float32_means_float32():
    """The fp32 comparisons run without TF32 (model.allow_tf32=false, the default): set before the ranks start CUDA,
    so they inherit NVIDIA_TF32_OVERRIDE=0 (Transformer Engine's GEMMs obey only that)."""
    from megarl.megatron.precision import apply_precision

    apply_precision(allow_tf32=False)
    yield


def _update(trainable, spec, batch):
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.train_step import loss_denominator, train_mini_batch

    micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(N)]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP_LOW, clip_ratio_high=CLIP_HIGH)
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    return train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))


def _build(hf_dir, dtype, distributed_optimizer):
    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.train_step import make_trainable

    model, spec = build_and_load(hf_dir, dtype=dtype)
    trainable = make_trainable(model, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=0.0), total_steps=10,
                               use_distributed_optimizer=distributed_optimizer)
    return trainable, spec


def _state(trainable, spec, batch) -> dict:
    from megarl.bridge.exporter import export_to_dict
    from megarl.megatron.forward import token_logprobs

    after = token_logprobs(trainable.chunks, batch["input_ids"], micro_batch_size=1)
    return {"after": after.float().cpu(),
            "weights": {k: v.float().cpu() for k, v in export_to_dict(trainable.chunks, spec).items()},
            "param_dtypes": sorted({str(p.dtype) for c in trainable.chunks for p in c.parameters()}),
            "main_dtypes": sorted({str(p.dtype) for g in trainable.optimizer.param_groups for p in g["params"]}),
            "device": str(next(trainable.chunks[0].parameters()).device)}


def update_rank(hf_dir, batch, dtype: str, distributed_optimizer: bool) -> dict:
    import torch.distributed as dist

    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.precision import apply_precision, tf32_in_effect

    apply_precision(allow_tf32=False)
    assert not tf32_in_effect()
    init_model_parallel(Layout(), seed=0)
    trainable, spec = _build(hf_dir, getattr(torch, dtype), distributed_optimizer)
    metrics = _update(trainable, spec, batch)
    return {"metrics": metrics, "backend": dist.get_backend(), **_state(trainable, spec, batch)}


def resume_rank(hf_dir, batch, ckpt_dir) -> dict:
    from megarl.checkpoint.state import load_trainable, save_trainable
    from megarl.megatron.parallel import Layout, init_model_parallel

    from megarl.megatron.precision import apply_precision

    apply_precision(allow_tf32=False)
    init_model_parallel(Layout(), seed=0)
    straight, spec = _build(hf_dir, torch.float32, False)
    _update(straight, spec, batch)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    save_trainable(straight, Path(ckpt_dir))
    _update(straight, spec, batch)
    resumed, _ = _build(hf_dir, torch.float32, False)
    load_trainable(resumed, Path(ckpt_dir))
    _update(resumed, spec, batch)
    return {"straight": _state(straight, spec, batch), "resumed": _state(resumed, spec, batch),
            "steps": (straight.steps, resumed.steps)}


def _close(a: dict, b: dict, tol: float) -> None:
    assert set(a) == set(b)
    for k in a:
        diff = (a[k] - b[k]).abs().max().item()
        assert diff <= tol, (k, diff)


def test_actor_update_at_tp1_with_nccl_equals_the_torch_reference(setup):  # noqa: F811
    hf_dir, batch, ref = setup
    (r,) = run_ranks(f"{__name__}:update_rank", 1, {"hf_dir": str(hf_dir), "batch": batch, "dtype": "float32",
                                                     "distributed_optimizer": False}, timeout=600)
    assert r["backend"] == "nccl" and r["device"].startswith("cuda")
    assert abs(r["metrics"]["pg_loss"] - ref["loss"]) < 1e-4, (r["metrics"], ref["loss"])
    assert abs(r["metrics"]["grad_norm"] - ref["grad_norm"]) < 1e-3 * max(1.0, ref["grad_norm"])
    mask = batch["input_ids"][:, 1:] != 0
    assert (r["after"] - ref["after"]).abs()[mask].max().item() < 5e-4
    names = set(ref["weights"]) - {"lm_head.weight"}
    for k in names:  # within Adam's bound everywhere, close where the reference gradient is well above eps
        diff = (r["weights"][k] - ref["weights"][k]).abs()
        assert diff.max().item() <= 2 * LR, k
        conditioned = ref["grads"][k].abs() > 1e-4
        if conditioned.any():
            assert diff[conditioned].max().item() < 1e-4, (k, diff[conditioned].max().item())


def test_bf16_trains_with_fp32_main_params(setup):  # noqa: F811
    hf_dir, batch, ref = setup
    (r,) = run_ranks(f"{__name__}:update_rank", 1, {"hf_dir": str(hf_dir), "batch": batch, "dtype": "bfloat16",
                                                     "distributed_optimizer": False}, timeout=600)
    assert r["param_dtypes"] == ["torch.bfloat16"] and r["main_dtypes"] == ["torch.float32"]
    assert abs(r["metrics"]["pg_loss"] - ref["loss"]) < 0.05 * max(1.0, abs(ref["loss"]))
    assert abs(r["metrics"]["grad_norm"] - ref["grad_norm"]) < 0.1 * ref["grad_norm"]
    mask = batch["input_ids"][:, 1:] != 0
    assert (r["after"] - ref["after"]).abs()[mask].mean().item() < 0.1  # bf16 logprobs: a few hundredths off


def test_distributed_optimizer_gives_the_same_update(setup):  # noqa: F811
    hf_dir, batch, _ = setup
    kwargs = {"hf_dir": str(hf_dir), "batch": batch, "dtype": "float32"}
    (plain,) = run_ranks(f"{__name__}:update_rank", 1, {**kwargs, "distributed_optimizer": False}, timeout=600)
    (dist_opt,) = run_ranks(f"{__name__}:update_rank", 1, {**kwargs, "distributed_optimizer": True}, timeout=600)
    assert abs(plain["metrics"]["grad_norm"] - dist_opt["metrics"]["grad_norm"]) < 1e-5 * plain["metrics"]["grad_norm"]
    _close(plain["weights"], dist_opt["weights"], 1e-6)


def test_resumed_update_equals_the_uninterrupted_one(setup, tmp_path):  # noqa: F811
    hf_dir, batch, _ = setup
    (r,) = run_ranks(f"{__name__}:resume_rank", 1, {"hf_dir": str(hf_dir), "batch": batch,
                                                     "ckpt_dir": str(tmp_path / "ckpt")}, timeout=600)
    assert r["steps"] == (2, 2)
    _close(r["straight"]["weights"], r["resumed"]["weights"], 1e-6)
    assert (r["straight"]["after"] - r["resumed"]["after"]).abs().max().item() < 1e-5


def test_bench_train_reports_tokens_per_second_and_mfu_for_a_1b_model():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train.py"), "--sizes", "1b", "--warmup", "1",
                          "--steps", "2"],
                         capture_output=True, text=True, timeout=1800, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    print(out.stdout)
    params = float(re.search(r"([\d.]+)B parameters", out.stdout).group(1))
    assert params >= 1.0
    rows = {m.group(1): m for m in re.finditer(r"(megarl TE|megarl no TE|plain torch)\S*(?: \(HF \+ AdamW\))?\s+"
                                                 r"([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)%\s+([\d.]+)x", out.stdout)}
    assert "megarl no TE" in rows and "plain torch" in rows, out.stdout
    for m in rows.values():
        assert float(m.group(3)) > 0 and 0 < float(m.group(5)) < 100, out.stdout
    # how fast the path without Transformer Engine is against plain torch is a figure of the benchmark (its target
    # line), not a test verdict: a timing depends on the machine
    assert re.search(r"^target: megarl no TE .* (MET|SHORT) \(([\d.]+)x\)$", out.stdout, re.M), out.stdout


def offload_rank(hf_dir, batch, distributed_optimizer: bool) -> dict:
    """bf16 with fp32 main params (and the distributed optimizer): offload frees GPU memory (measured by the
    allocator) and the round trip is bitwise."""
    from megarl.megatron.offload import StateOffloader, category_tensors
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(), seed=0)
    trainable, spec = _build(hf_dir, torch.bfloat16, distributed_optimizer)
    _update(trainable, spec, batch)
    snap = [t.detach().clone().cpu() for ts in category_tensors(trainable.chunks, trainable.optimizer).values()
            for t in ts]
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    off = StateOffloader(trainable.chunks, trainable.optimizer)
    stats = off.offload()
    allocated_off = torch.cuda.memory_allocated()
    staging = off._staging.buffer
    pinned = off._staging.pinned and staging.is_pinned()
    off.onload()
    after = [t.detach().cpu() for ts in category_tensors(trainable.chunks, trainable.optimizer).values() for t in ts]
    metrics = _update(trainable, spec, batch)  # trains on after the round trip
    again = off.offload()  # the second offload reuses the staging area
    reused = off._staging.buffer.data_ptr() == staging.data_ptr()
    off.release()
    return {"bytes": stats["bytes"], "freed": stats["freed_bytes"], "allocated_freed": allocated - allocated_off,
            "bitwise": len(snap) == len(after) and all(torch.equal(a, b) for a, b in zip(snap, after)),
            "grad_norm": metrics["grad_norm"], "pinned": pinned, "reused": reused and again["bytes"] == stats["bytes"],
            "released": off.staging_bytes() == 0}


@pytest.mark.parametrize("distributed_optimizer", [False, True], ids=["optimizer", "distributed-optimizer"])
def test_offload_round_trip_on_the_gpu(setup, distributed_optimizer):  # noqa: F811
    hf_dir, batch, _ = setup
    (r,) = run_ranks(f"{__name__}:offload_rank", 1, {"hf_dir": str(hf_dir), "batch": batch,
                                                      "distributed_optimizer": distributed_optimizer}, timeout=600)
    assert r["bitwise"] and r["bytes"] > 0 and r["grad_norm"] == r["grad_norm"]
    assert r["allocated_freed"] >= 0.9 * r["bytes"], r  # the allocator no longer holds what was moved
    assert r["pinned"] and r["reused"] and r["released"], r  # one page-locked staging area, reused, then freed
