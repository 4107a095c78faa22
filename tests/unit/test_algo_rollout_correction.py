"""Rollout correction: truncated IS weights, rejection masks and mismatch metrics against loops."""
import math

import pytest
import torch

from megarl.algo import ppo_clip_loss, rollout_is_weights, rollout_mismatch_metrics, rollout_rejection_mask

# ratio pi_train / pi_rollout per token; row 2 holds extreme ratios, (1, 3) and (2, 3) are padding
RATIOS = [[1.0, 1.5, 3.0, 0.9],
          [0.5, 0.8, 1.1, 1.0],
          [1e6, 1e-6, 1.0, 1.0]]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)


def _logprobs():
    rollout = torch.tensor([[-0.5, -1.0, -2.0, -0.1], [-1.5, -0.7, -0.3, -2.0], [-20.0, -0.2, -1.0, -1.0]],
                           dtype=torch.float64)
    old = rollout + torch.tensor(RATIOS, dtype=torch.float64).log()
    return old, rollout


def _valid(b):
    return [t for t in range(4) if MASK[b, t]]


def test_token_is_weights_truncate():
    old, rollout = _logprobs()
    w, m = rollout_is_weights(old, rollout, MASK, level="token", threshold=2.0)
    for b in range(3):
        for t in range(4):
            expected = min(RATIOS[b][t], 2.0) if MASK[b, t] else 0.0
            assert w[b, t].item() == pytest.approx(expected, rel=1e-9)
    assert m["is_truncated_frac"].item() == pytest.approx(2 / 10)  # 3.0 and 1e6
    assert m["is_weight_max"].item() == pytest.approx(1e6, rel=1e-6)
    valid = [min(RATIOS[b][t], 2.0) for b in range(3) for t in _valid(b)]
    assert m["is_weight_mean"].item() == pytest.approx(sum(valid) / len(valid))
    lower, _ = rollout_is_weights(old, rollout, MASK, level="token", threshold=2.0, threshold_lower=0.6)
    assert lower[1, 0].item() == pytest.approx(0.6) and lower[2, 1].item() == pytest.approx(0.6)


def test_sequence_is_weights_use_the_product():
    old, rollout = _logprobs()
    w, m = rollout_is_weights(old, rollout, MASK, level="sequence", threshold=5.0)
    for b in range(3):
        prod = math.prod(RATIOS[b][t] for t in _valid(b))  # row 0: 4.05, row 1: 0.44, row 2: 1.0
        for t in range(4):
            assert w[b, t].item() == pytest.approx(min(prod, 5.0) if MASK[b, t] else 0.0, rel=1e-9)
    assert m["is_truncated_frac"].item() == 0.0
    w, m = rollout_is_weights(old, rollout, MASK, level="sequence", threshold=2.0)
    assert w[0, 0].item() == pytest.approx(2.0) and m["is_truncated_frac"].item() == pytest.approx(1 / 3)


def test_is_weights_plug_into_policy_loss_without_gradient():
    old, rollout = _logprobs()
    w, _ = rollout_is_weights(old, rollout, MASK, level="token", threshold=2.0)
    assert not w.requires_grad
    lp = old.clone().requires_grad_(True)
    adv = torch.ones(3, 4, dtype=torch.float64)
    loss, _ = ppo_clip_loss(old, lp, adv, MASK, rollout_is_weights=w)
    loss.backward()
    assert loss.item() == pytest.approx(-w[MASK].sum().item() / 10)  # on-policy ratio 1: loss = -mean(w * A)


@pytest.mark.parametrize("level, threshold, rejected", [
    # token: interval [0.4, 2.5]: reject 3.0 (0,2), 1e6 (2,0), 1e-6 (2,1); 0.5 is kept
    ("token", 2.5, {(0, 2), (2, 0), (2, 1)}),
    # sequence products, interval [0.5, 2]: row 0 = 4.05 (reject), row 1 = 0.44 (reject), row 2 = 1.0 (keep)
    ("sequence", 2.0, {(0, t) for t in range(4)} | {(1, t) for t in range(3)}),
])
def test_rejection_token_and_sequence(level, threshold, rejected):
    old, rollout = _logprobs()
    keep, m = rollout_rejection_mask(old, rollout, MASK, level=level, threshold=threshold)
    for b in range(3):
        for t in range(4):
            assert keep[b, t].item() == (bool(MASK[b, t]) and (b, t) not in rejected), (level, b, t)
    assert m["rejected_token_frac"].item() == pytest.approx(len(rejected) / 10)
    assert m["rejected_seq_frac"].item() == pytest.approx(len({b for b, _ in rejected}) / 3)


def test_rejection_geometric_mean():
    old, rollout = _logprobs()
    # geometric means: row 0 = 4.05^(1/4) = 1.4186, row 1 = 0.44^(1/3) = 0.7606, row 2 = 1.0
    keep, _ = rollout_rejection_mask(old, rollout, MASK, level="geometric", threshold=1.3, threshold_lower=0.7)
    assert keep.tolist() == [[False] * 4, [True, True, True, False], [True, True, True, False]]
    keep, _ = rollout_rejection_mask(old, rollout, MASK, level="geometric", threshold=1.5)  # lower 1/1.5
    assert keep[0].all() and keep[1, :3].all()


def test_rejection_bad_arguments():
    old, rollout = _logprobs()
    with pytest.raises(ValueError, match=r"unknown rollout rejection level 'geo'.*"):
        rollout_rejection_mask(old, rollout, MASK, level="geo")
    with pytest.raises(ValueError, match=r"threshold=0.5 is out of range; expected >= 1"):
        rollout_rejection_mask(old, rollout, MASK, threshold=0.5)
    with pytest.raises(ValueError, match=r"rollout_log_prob has shape \(3, 3\) but old_log_prob has shape \(3, 4\)"):
        rollout_is_weights(old, rollout[:, :3], MASK)


def test_mismatch_metrics_match_loop():
    old, rollout = _logprobs()
    m = rollout_mismatch_metrics(old, rollout, MASK)
    tokens = [(b, t) for b in range(3) for t in _valid(b)]
    log_r = {(b, t): math.log(RATIOS[b][t]) for b, t in tokens}
    n = len(tokens)
    assert m["mismatch_kl"].item() == pytest.approx(sum(-x for x in log_r.values()) / n)
    assert m["mismatch_k3_kl"].item() == pytest.approx(sum(math.exp(x) - 1 - x for x in log_r.values()) / n, rel=1e-9)
    assert m["mismatch_chi2_token"].item() == pytest.approx(sum(math.exp(2 * x) for x in log_r.values()) / n - 1,
                                                            rel=1e-9)
    seq_chi = [math.exp(2 * sum(log_r[(b, t)] for t in _valid(b))) for b in range(3)]
    assert m["mismatch_chi2_seq"].item() == pytest.approx(sum(seq_chi) / 3 - 1, rel=1e-9)
    train_ppl = [-sum(old[b, t].item() for t in _valid(b)) / len(_valid(b)) for b in range(3)]
    roll_ppl = [-sum(rollout[b, t].item() for t in _valid(b)) / len(_valid(b)) for b in range(3)]
    assert m["training_log_ppl"].item() == pytest.approx(sum(train_ppl) / 3)
    assert m["rollout_log_ppl"].item() == pytest.approx(sum(roll_ppl) / 3)
    diffs = [a - b for a, b in zip(train_ppl, roll_ppl)]
    assert m["mismatch_log_ppl_diff"].item() == pytest.approx(sum(diffs) / 3)
    assert m["mismatch_log_ppl_abs_diff"].item() == pytest.approx(sum(abs(d) for d in diffs) / 3)


def test_identical_policies_have_no_mismatch():
    old, _ = _logprobs()
    m = rollout_mismatch_metrics(old, old.clone(), MASK)
    for name in ("mismatch_kl", "mismatch_k3_kl", "mismatch_chi2_token", "mismatch_chi2_seq", "mismatch_log_ppl_diff"):
        assert m[name].item() == pytest.approx(0.0, abs=1e-12), name
    w, wm = rollout_is_weights(old, old.clone(), MASK, level="sequence")
    assert w[MASK].tolist() == pytest.approx([1.0] * 10) and wm["is_truncated_frac"].item() == 0.0
    keep, _ = rollout_rejection_mask(old, old.clone(), MASK, level="geometric", threshold=1.0001)
    assert torch.equal(keep, MASK)
