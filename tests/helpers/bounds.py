"""Tolerances of the parity tests, derived from the computation (megarl.numerics), never fitted to one CPU's rounding.

    tol = logprob_bound(hf_dir, tokens, mask)        # megarl vs HF (or vs another megarl layout), one fp32 forward
    tol = after_step_bound(hf_dir, tokens, mask, moved)  # the same after one well-conditioned optimizer step

A float32 forward of one model by two implementations (another layout, kernel set or library) differs by rounding
only: megarl.numerics bounds that from the model's widths, depth, vocabulary and logits (what `megarl verify` uses).

After an optimizer step the weights differ too. Adam's first step moves each weight by lr * g / (|g| + eps): where |g|
is near eps that turns float noise into moves of up to lr, a sensitivity of lr / eps (1e5 at the defaults) that no
rounding analysis bounds usefully. Tests that compare logprobs after a step therefore use ADAM_EPS = 1e-3: the
sensitivity is at most lr / eps = LR / 1e-3 (1 at lr 1e-3), so the weights differ by at most the gradients' own rounding,
whose relative size is the forward's (backward runs the same sums transposed). The logprobs after the step then differ
by the forward bound plus that relative error times how far the step moved them.
Tests of the optimizer itself (Adam at its real eps) compare weights where |g| >> eps instead (test_actor_step).

    lp, tol = forward_with_weights(hf_dir, weights, tokens, mask)  # HF on other weights (exported, merged, trained)
    tol = logits_bound(hf_dir, logits, mask)                     # from a reference's logits [B, S-1, V] (e.g. PEFT)
    tol = score_bound(hf_dir, scores, seq_len)                   # scores / values: a linear read-out of the last state
    tol = verify_bound(hf_dir, seq_len, batch, lora=None)        # what `megarl verify`'s batch allows
    tol = rollout_bound(batch, model)                            # an engine's sampled tokens vs the HF model
    tol = lora_merge_bound(w, a, b, scaling)                     # w + scaling * (b @ a) computed twice, elementwise
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

ADAM_EPS = 1e-3  # well-conditioned Adam for after-step comparisons (see above)


def _logits(hf_dir, tokens):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()[:, :-1]


def logprob_bound(hf_dir: Union[str, Path], tokens, mask: Optional[object] = None) -> float:
    """Max abs logprob difference two correct float32 forwards of the model at hf_dir may show on tokens [B, S] over
    the positions of mask [B, S-1] (default: all)."""
    return logits_bound(hf_dir, _logits(hf_dir, tokens), mask)


def logits_bound(hf_dir: Union[str, Path], logits, mask: Optional[object] = None,
                 seq_len: Optional[int] = None) -> float:
    """logprob_bound from a reference forward's logits [B, S-1, V] (the model at hf_dir's architecture, any weights:
    trained, merged, or with a PEFT adapter on it) over the positions of mask [B, S-1] (default: all); seq_len: the
    longest sequence they come from when not S (positions gathered from several sequences)."""
    import torch

    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound

    logits = logits.float()
    if mask is None:
        mask = torch.ones(logits.shape[:2], dtype=torch.bool)
    mask = mask.bool()
    rms = float(logits[mask].pow(2).mean().sqrt())
    return fp32_bound(load_spec(str(hf_dir)), seq_len or logits.shape[1] + 1, int(mask.sum()), rms)


def hf_model_with_weights(hf_dir: Union[str, Path], weights: dict):
    """HF transformers' model of the architecture at hf_dir (float32, eager attention, eval mode) loaded with `weights`
    (HF checkpoint names: an exported or merged state dict; a tied head may be left out) as a checkpoint, so
    transformers converts its per-expert names into fused modules; ValueError where they do not fit exactly."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(Path(hf_dir) / "config.json", Path(tmp) / "config.json")
        tensors = {k: v.detach().float().contiguous() for k, v in weights.items()}
        save_file(tensors, str(Path(tmp) / "model.safetensors"), metadata={"format": "pt"})
        model, info = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32, attn_implementation="eager",
                                                           output_loading_info=True)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [k for k in info["missing_keys"] if not (tied and k == "lm_head.weight")]
    if missing or info["unexpected_keys"] or info.get("mismatched_keys"):
        raise ValueError(f"weights do not fit {hf_dir}: missing {missing[:5]}, unexpected "
                         f"{list(info['unexpected_keys'])[:5]}, mismatched {list(info.get('mismatched_keys', []))[:5]}")
    return model.eval()


def forward_with_weights(hf_dir: Union[str, Path], weights: dict, tokens, mask: Optional[object] = None) -> tuple:
    """(logprobs [B, S-1], logprob_bound) of HF transformers running the architecture at hf_dir with `weights`
    (hf_model_with_weights). The pure-forward check of weights an optimizer step produced: the step itself is checked
    where the weights are compared."""
    return forward_of(hf_model_with_weights(hf_dir, weights), hf_dir, tokens, mask)


def forward_of(model, hf_dir: Union[str, Path], tokens, mask: Optional[object] = None) -> tuple:
    """(logprobs [B, S-1], logprob_bound) of an HF transformers model (hf_model_with_weights) of the architecture at
    hf_dir."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    return lp, logits_bound(hf_dir, logits, mask)


def score_bound(hf_dir: Union[str, Path], scores, seq_len: int) -> float:
    """Max abs difference two correct float32 forwards may show on reward-model scores or critic values (a linear
    read-out of the last hidden state, megarl.numerics.fp32_output_bound): `scores` are the reference's (any shape:
    their count is the number of outputs, their RMS the output scale) on sequences of seq_len tokens."""
    import torch

    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound

    scores = torch.as_tensor(scores, dtype=torch.float32).flatten()
    rms = float(scores.pow(2).mean().sqrt())
    return fp32_bound(load_spec(str(hf_dir)), seq_len, scores.numel(), rms, score=True)


def verify_bound(hf_dir: Union[str, Path], seq_len: int, batch: int, lora: Optional[str] = None,
                 score: bool = False) -> float:
    """The logprob bound (score=True: the reward model's score bound) on the batch `megarl verify --seq-len seq_len
    --batch batch` builds for hf_dir (with a PEFT adapter on the reference when lora is given), computed here from
    HF's own outputs."""
    from megarl import hf_reference
    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound
    from megarl.verify import make_batch

    tokens, lengths, _ = make_batch(str(hf_dir), load_spec(str(hf_dir)).vocab_size, batch, seq_len)
    if score:
        return score_bound(hf_dir, hf_reference.hf_scores(str(hf_dir), tokens, lengths), seq_len)
    _, stats = hf_reference.hf_logprobs(str(hf_dir), tokens, lengths, lora=lora)
    n = int(hf_reference.real_mask(lengths, seq_len - 1).sum())
    return fp32_bound(load_spec(str(hf_dir)), seq_len, n, stats.rms)


def relative_error(hf_dir: Union[str, Path], seq_len: int, n_values: int) -> float:
    """The relative rounding error of the model's outputs (and, transposed, of its gradients) over n_values values."""
    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import FP32_UNIT, fp32_logit_error_factor, layer_widths, tail_factor

    spec = load_spec(str(hf_dir))
    factor = fp32_logit_error_factor(spec.hidden_size, layer_widths(spec, seq_len), spec.num_layers)
    return 2.0 * factor * FP32_UNIT * tail_factor(n_values)


def after_step_bound(hf_dir: Union[str, Path], tokens, mask, moved: float, lr: float,
                     eps: float = ADAM_EPS, before: Optional[float] = None) -> float:
    """Max abs logprob difference after one Adam step with `eps` and `lr` (sensitivity lr / eps <= 1 required) of two
    correct implementations, when the step moved the logprobs by at most `moved`. `before`: the forward bound of the
    model the step started from when it is not the one at hf_dir (a trained or resumed model; forward_with_weights)."""
    if lr / eps > 1.0:
        raise ValueError(f"after_step_bound needs lr / eps <= 1 (got {lr} / {eps}): see tests/helpers/bounds.py")
    n = int(mask.sum())
    if before is None:
        before = logprob_bound(hf_dir, tokens, mask)
    return before + relative_error(hf_dir, tokens.shape[1], n) * moved


def rollout_bound(batch, model) -> float:
    """The logprob bound on a rollout's sampled tokens (batch: megarl.types.RolloutBatch) against an HF model object
    (loaded from a directory, whose config gives the widths): its logits over every response position of every row."""
    import torch

    rows, longest = [], 0
    for i in range(len(batch)):
        prompt, response = list(batch.prompt_ids[i]), list(batch.response(i))
        ids = torch.tensor([prompt + response])
        longest = max(longest, ids.shape[1])
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        rows.append(logits[len(prompt) - 1: len(prompt) + len(response) - 1])
    return logits_bound(model.name_or_path, torch.cat(rows)[None], seq_len=longest)


def lora_merge_bound(w, a, b, scaling: float):
    """Elementwise bound [out, in] on two float32 computations of a merged LoRA weight w + scaling * (b @ a) (b [out, r],
    a [r, in]; scaling a power of two, so its product is exact). GEMM libraries order and block the rank-r sums by the
    CPU's vector width and the operands' layout, so the two may differ in the last bits. Each is within the classic
    worst case of the exact value: gamma_r * scaling * (|b| @ |a|) for the sum of r products, gamma_r = r u / (1 - r u),
    plus u * |result| for the final addition (u = 2^-24); two computations differ by at most twice that."""
    import torch

    u = torch.finfo(torch.float32).eps / 2
    r = a.shape[0]
    gamma = r * u / (1 - r * u)
    spread = scaling * (b.double().abs() @ a.double().abs())
    return 2 * (gamma * spread + u * (w.double().abs() + spread))


def assert_same_ppo_step(label: str, hf_dir: Union[str, Path], batch: dict, runs_a: list, runs_b: list, lr: float,
                         tp: int = 1) -> None:
    """One PPO step (token-mean of -A * ratio, Adam with ADAM_EPS) computed two ways (runs_a / runs_b: each rank's
    {"metrics", "params"}, paired rank by rank) gives the same loss, grad norm and parameters within derived bounds.

    The two forwards differ by rounding only, at most `tol` per logprob (the derived fp32 bound). Loss (ratio =
    exp(lp - old) ~ 1 on-policy): |d loss| <= max|A| * e^tol * (e^tol - 1). Gradients: the same sums in another
    order, relative error `rel` of the model's outputs, transposed, plus what the logprob differences change in
    dL/dlp (|A| * ratio): |d grad_norm| <= grad_norm * (rel + e^tol - 1). Adam's first step is lr * g / (|g| + eps),
    whose slope in g is at most lr / eps: a parameter moves by at most (lr / eps) * (rel + e^tol - 1) * grad_norm,
    and never more than 2 * lr."""
    import torch

    mask = batch["response_mask"]
    tol = logprob_bound(hf_dir, batch["input_ids"], mask)
    rel = relative_error(hf_dir, batch["input_ids"].shape[1],
                         sum(p.numel() for p in runs_a[0]["params"].values()) * tp)
    amax = float(batch["advantages"][mask].abs().max())
    growth = torch.tensor(tol).expm1().item()
    for a_run, b_run in zip(runs_a, runs_b):
        a, b = a_run["metrics"], b_run["metrics"]
        loss_tol = amax * (1 + growth) * growth
        gn = b["grad_norm"]
        gn_tol = (rel + growth) * gn
        w_tol = min(2 * lr, lr / ADAM_EPS * (rel + growth) * gn)
        w_diff = max((a_run["params"][k] - b_run["params"][k]).abs().max().item() for k in a_run["params"])
        print(f"[measured] {label}: loss {abs(a['pg_loss'] - b['pg_loss']):.2e} (bound {loss_tol:.2e}), grad norm "
              f"{abs(a['grad_norm'] - gn):.2e} (bound {gn_tol:.2e}), parameters {w_diff:.2e} (bound {w_tol:.2e})")
        assert abs(a["pg_loss"] - b["pg_loss"]) <= loss_tol
        assert abs(a["grad_norm"] - gn) <= gn_tol
        assert w_diff <= w_tol
