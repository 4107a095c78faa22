"""Masked reductions over padded [B, T] tensors.

Positions where the mask is False are excluded with `torch.where`, not multiplied by 0, so padding that holds
NaN or inf (e.g. log-probs the model never computed) cannot poison the result.
"""
from __future__ import annotations

import torch

from megarl.algo._checks import check_floating, check_mask


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of values where mask is set.

    values: any shape; mask: same shape, bool or 0/1. dim: reduce over this dim, or everything when None.
    """
    m = check_mask("mask", mask, "values", values)
    masked = torch.where(m, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum() if dim is None else masked.sum(dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of values where mask is set.

    values: any shape, floating; mask: same shape, bool or 0/1. dim: reduce over this dim, or everything when None.
    An empty selection gives 0, not NaN: a row or micro-batch with no valid token contributes nothing.
    """
    check_floating("values", values)
    m = check_mask("mask", mask, "values", values)
    count = m.sum() if dim is None else m.sum(dim)
    return masked_sum(values, m, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of values where mask is set, over all positions (0-d tensor).

    unbiased applies Bessel's correction n/(n-1) when n > 1; with n <= 1 the variance is 0.
    """
    m = check_mask("mask", mask, "values", values)
    mean = masked_mean(values, m)
    var = masked_mean((values - mean) ** 2, m)
    if unbiased:
        n = m.sum()
        # torch.where rather than an `if` keeps this free of a device->host sync.
        var = torch.where(n > 1, var * n / (n - 1).clamp(min=1), var)
    return var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True,
                  epsilon: float = 1e-8) -> torch.Tensor:
    """Normalise values to zero mean and unit variance over the masked positions.

    values: any shape, floating; mask: same shape. Mean and (unbiased) variance are taken over all masked
    positions together. shift_mean=False keeps the original mean (only rescales). Masked-out positions are 0.
    Constant values come out as 0 (their variance is 0 and epsilon keeps the division finite).
    """
    m = check_mask("mask", mask, "values", values)
    mean = masked_mean(values, m)
    var = masked_var(values, m, unbiased=True)
    whitened = (values - mean) * torch.rsqrt(var + epsilon)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(m, whitened, torch.zeros((), dtype=whitened.dtype, device=whitened.device))
