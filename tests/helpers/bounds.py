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
    import torch

    from megarl.bridge.hf_config import load_spec
    from megarl.verify import fp32_bound

    logits = _logits(hf_dir, tokens)
    if mask is None:
        mask = torch.ones(logits.shape[:2], dtype=torch.bool)
    mask = mask.bool()
    rms = float(logits[mask].pow(2).mean().sqrt())
    return fp32_bound(load_spec(str(hf_dir)), tokens.shape[1], int(mask.sum()), rms)


def relative_error(hf_dir: Union[str, Path], seq_len: int, n_values: int) -> float:
    """The relative rounding error of the model's outputs (and, transposed, of its gradients) over n_values values."""
    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import FP32_UNIT, fp32_logit_error_factor, tail_factor
    from megarl.verify import layer_widths

    spec = load_spec(str(hf_dir))
    factor = fp32_logit_error_factor(spec.hidden_size, layer_widths(spec, seq_len), spec.num_layers)
    return 2.0 * factor * FP32_UNIT * tail_factor(n_values)


def after_step_bound(hf_dir: Union[str, Path], tokens, mask, moved: float, lr: float,
                     eps: float = ADAM_EPS) -> float:
    """Max abs logprob difference after one Adam step with `eps` and `lr` (sensitivity lr / eps <= 1 required) of two
    correct implementations, when the step moved the logprobs by at most `moved`."""
    if lr / eps > 1.0:
        raise ValueError(f"after_step_bound needs lr / eps <= 1 (got {lr} / {eps}): see tests/helpers/bounds.py")
    n = int(mask.sum())
    return logprob_bound(hf_dir, tokens, mask) + relative_error(hf_dir, tokens.shape[1], n) * moved
