"""Masked reductions and loss aggregation against plain-Python loops."""
import math

import pytest
import torch

from megarl.algo import agg_loss, masked_mean, masked_sum, masked_var, masked_whiten

LOSS = torch.tensor([[1.0, 2.0, 3.0, 4.0],
                     [5.0, 6.0, 0.0, 0.0],
                     [7.0, 0.0, 0.0, 0.0],
                     [9.0, 9.0, 9.0, 9.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 0],
                     [1, 1, 0, 0],
                     [1, 0, 0, 0],
                     [0, 0, 0, 0]], dtype=torch.bool)  # last row: all padding


def _rows():
    """Valid entries per row, as Python lists."""
    return [[v for v, m in zip(lr, mr) if m] for lr, mr in zip(LOSS.tolist(), MASK.tolist())]


def _ref(mode, max_len=4):
    rows = [r for r in _rows() if r]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-sum":
        return sum(sum(r) for r in rows) / len(rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) / max_len for r in rows) / len(rows)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_modes_match_loops(mode):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(_ref(mode))


def test_agg_hand_values():
    # valid rows: [1,2,3], [5,6], [7]
    assert agg_loss(LOSS, MASK, "token-mean").item() == pytest.approx(24 / 6)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 11 + 7) / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 5.5 + 7) / 3)
    assert agg_loss(LOSS, MASK, "seq-mean-token-sum-norm", max_response_length=8).item() == pytest.approx(24 / 8 / 3)


def test_padding_may_hold_nan():
    loss = LOSS.clone()
    loss[~MASK] = float("nan")
    for mode in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        assert agg_loss(loss, MASK, mode).item() == pytest.approx(_ref(mode))


def test_denominator_makes_micro_batches_sum_to_the_whole():
    whole = agg_loss(LOSS, MASK, "token-mean")
    parts = [agg_loss(LOSS[i:i + 2], MASK[i:i + 2], "token-mean", denominator=MASK.sum()) for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())
    whole = agg_loss(LOSS, MASK, "seq-mean-token-mean")
    parts = [agg_loss(LOSS[i:i + 2], MASK[i:i + 2], "seq-mean-token-mean", denominator=3) for i in (0, 2)]
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item())


def test_all_padding_gives_zero_not_nan():
    for mode in ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]:
        assert agg_loss(LOSS, torch.zeros_like(MASK), mode).item() == 0.0


def test_agg_gradient_weights():
    loss = LOSS.clone().requires_grad_(True)
    agg_loss(loss, MASK, "seq-mean-token-mean").backward()
    lengths = MASK.sum(-1).tolist()
    for b in range(4):
        for t in range(4):
            expected = 1 / (lengths[b] * 3) if MASK[b, t] else 0.0
            assert loss.grad[b, t].item() == pytest.approx(expected)


def test_masked_mean_sum_dim():
    assert masked_sum(LOSS, MASK).item() == 24
    per_row = masked_mean(LOSS, MASK, dim=-1)
    assert per_row.tolist() == pytest.approx([2.0, 5.5, 7.0, 0.0])


def test_masked_var_and_whiten_match_loop():
    flat = [v for r in _rows() for v in r]
    n = len(flat)
    mean = sum(flat) / n
    var = sum((v - mean) ** 2 for v in flat) / (n - 1)
    assert masked_var(LOSS, MASK).item() == pytest.approx(var)
    assert masked_var(LOSS, MASK, unbiased=False).item() == pytest.approx(var * (n - 1) / n)
    white = masked_whiten(LOSS, MASK)
    for b in range(4):
        for t in range(4):
            expected = (LOSS[b, t].item() - mean) / math.sqrt(var + 1e-8) if MASK[b, t] else 0.0
            assert white[b, t].item() == pytest.approx(expected)
    kept_mean = masked_whiten(LOSS, MASK, shift_mean=False)
    assert masked_mean(kept_mean, MASK).item() == pytest.approx(mean)


def test_whiten_constant_and_single_value():
    const = torch.full((2, 3), 5.0)
    assert masked_whiten(const, torch.ones(2, 3)).abs().max().item() == 0.0
    one = torch.zeros(2, 3, dtype=torch.bool)
    one[0, 0] = True
    assert masked_var(const, one).item() == 0.0
    assert masked_whiten(const, one).abs().max().item() == 0.0
