"""Policy losses: values against per-token loops, gradients against analytic expressions."""
import math

import pytest
import torch

from megarl.algo import POLICY_LOSSES, cispo_loss, gspo_loss, ppo_clip_loss

LOW, HIGH, C = 0.2, 0.28, 3.0

# (ratio, advantage) per token; what the clip does with low=0.2, high=0.28, c=3 is noted.
CASES = [
    [(1.1, 1.0), (1.5, 1.0), (0.5, 1.0), (1.25, 1.0)],     # in range, upper clip, unclipped (A>0, r<1), in range
    [(0.5, -1.0), (1.5, -1.0), (5.0, -1.0), (1.0, 0.0)],   # lower clip, unclipped, dual clip, zero advantage
    [(1e6, 1.0), (1e6, -2.0), (1e-6, 1.0), (1e-6, -1.0)],  # extreme: upper clip, dual clip, unclipped, lower clip
]
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)  # (1, 3) is padding


def _tensors(cases=CASES, seed=0):
    g = torch.Generator().manual_seed(seed)
    ratio = torch.tensor([[r for r, _ in row] for row in cases], dtype=torch.float64)
    adv = torch.tensor([[a for _, a in row] for row in cases], dtype=torch.float64)
    old = -torch.rand(ratio.shape, generator=g, dtype=torch.float64) * 3
    log_prob = (old + ratio.log()).requires_grad_(True)
    return old, log_prob, adv


def _ppo_token_ref(ratio, adv, low, high, c):
    loss = max(-adv * ratio, -adv * min(max(ratio, 1 - low), 1 + high))
    if c is not None and adv < 0:
        loss = min(loss, -adv * c)
    return loss


def _valid_cells(mask):
    return [(b, t) for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]


@pytest.mark.parametrize("c", [C, None])
def test_ppo_loss_matches_loop(c):
    old, lp, adv = _tensors()
    loss, _ = ppo_clip_loss(old, lp, adv, MASK, "token-mean", LOW, HIGH, c)
    cells = _valid_cells(MASK)
    ref = sum(_ppo_token_ref(CASES[b][t][0], CASES[b][t][1], LOW, HIGH, c) for b, t in cells) / len(cells)
    assert loss.item() == pytest.approx(ref, rel=1e-9)


def test_ppo_metrics_match_hand_counts():
    old, lp, adv = _tensors()
    _, m = ppo_clip_loss(old, lp, adv, MASK, "token-mean", LOW, HIGH, C)
    n = 11  # valid tokens
    # upper: (0,1) r=1.5 and (2,0) r=1e6, both A>0. lower: (1,0) r=0.5 and (2,3) r=1e-6, both A<0.
    assert m["pg_clipfrac_upper"].item() == pytest.approx(2 / n)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(2 / n)
    assert m["pg_clipfrac"].item() == pytest.approx(4 / n)
    # dual: (1,2) r=5 A=-1 and (2,1) r=1e6 A=-2
    assert m["dual_clip_frac"].item() == pytest.approx(2 / n)
    ref_kl = sum(-math.log(CASES[b][t][0]) for b, t in _valid_cells(MASK)) / n
    assert m["ppo_kl"].item() == pytest.approx(ref_kl, rel=1e-9)
    assert all(v.dim() == 0 and not v.requires_grad for v in m.values())


def test_ppo_gradient_zero_exactly_where_clipped():
    old, lp, adv = _tensors()
    loss, _ = ppo_clip_loss(old, lp, adv, MASK, "token-mean", LOW, HIGH, C)
    loss.backward()
    n = 11
    clipped = {(0, 1), (1, 0), (1, 2), (2, 0), (2, 1), (2, 3)}
    for b in range(3):
        for t in range(4):
            r, a = CASES[b][t]
            # d(-A r)/d log_prob = -A r for an active unclipped branch
            want = 0.0 if (b, t) in clipped or not MASK[b, t] else -a * r / n
            assert lp.grad[b, t].item() == pytest.approx(want, abs=1e-12), (b, t)


def test_clip_higher_is_asymmetric():
    old, lp, adv = _tensors([[(1.25, 1.0), (0.78, -1.0)]], seed=1)
    mask = torch.ones(1, 2, dtype=torch.bool)
    _, sym = ppo_clip_loss(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    _, asym = ppo_clip_loss(old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert sym["pg_clipfrac_upper"].item() == 0.5 and asym["pg_clipfrac_upper"].item() == 0.0
    assert sym["pg_clipfrac_lower"].item() == asym["pg_clipfrac_lower"].item() == 0.5


def test_dual_clip_bounds_negative_advantage_loss():
    ratios = [1e-6, 0.5, 1.0, 2.0, 3.0, 10.0, 1e3, 1e6]
    old, lp, adv = _tensors([[(r, -2.0) for r in ratios]])
    mask = torch.ones(1, len(ratios), dtype=torch.bool)
    loss, _ = ppo_clip_loss(old, lp, adv, mask, "token-mean", LOW, HIGH, C)
    per_token = [_ppo_token_ref(r, -2.0, LOW, HIGH, C) for r in ratios]
    assert max(per_token) == 2.0 * C
    assert loss.item() == pytest.approx(sum(per_token) / len(ratios))
    loss.backward()
    assert lp.grad[0, -3:].abs().max().item() == 0.0  # r > c: bounded, no gradient
    unbounded, _ = ppo_clip_loss(old, lp.detach(), adv, mask, "token-mean", LOW, HIGH, None)
    assert unbounded.item() > 1e5


# settings a loss has no default for (dro's beta)
OPTIONS = {"dro": {"dro_beta": 0.1}}


def test_extreme_log_ratios_stay_finite():
    old = torch.zeros(2, 3, dtype=torch.float64)
    lp = torch.tensor([[100.0, -100.0, 0.0], [50.0, -50.0, 0.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0], [-1.0, 1.0, -1.0]], dtype=torch.float64)
    for name, fn in POLICY_LOSSES.items():
        lp.grad = None
        loss, m = fn(old, lp, adv, torch.ones(2, 3), **OPTIONS.get(name, {}))
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(lp.grad).all(), name
        assert all(torch.isfinite(v) for v in m.values()), name


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_padding_garbage_is_ignored(name):
    old, lp, adv = _tensors()
    garbage_lp = lp.detach().clone()
    garbage_lp[~MASK] = float("nan")
    garbage_lp.requires_grad_(True)
    garbage_old = old.clone()
    garbage_old[~MASK] = float("inf")
    clean, _ = POLICY_LOSSES[name](old, lp, adv, MASK, **OPTIONS.get(name, {}))
    dirty, _ = POLICY_LOSSES[name](garbage_old, garbage_lp, adv, MASK, **OPTIONS.get(name, {}))
    dirty.backward()
    assert dirty.item() == pytest.approx(clean.item())
    assert garbage_lp.grad[~MASK].abs().max().item() == 0.0 and torch.isfinite(garbage_lp.grad).all()


def test_rollout_is_weights_multiply_token_losses():
    old, lp, adv = _tensors()
    w = torch.linspace(0.5, 2.0, 12, dtype=torch.float64).reshape(3, 4)
    loss, _ = ppo_clip_loss(old, lp, adv, MASK, "seq-mean-token-sum", LOW, HIGH, C, rollout_is_weights=w)
    rows = [[_ppo_token_ref(*CASES[b][t], LOW, HIGH, C) * w[b, t].item() for t in range(4) if MASK[b, t]]
            for b in range(3)]
    assert loss.item() == pytest.approx(sum(sum(r) for r in rows) / 3)


# ---------------------------------------------------------------- GSPO

def _gspo_setup():
    # Per-row mean log-ratio chosen to land in or out of the clip range [0.8, 1.2]: row 3 is all padding.
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.bool)
    mean_log_ratio = [0.05, 0.5, -0.5, -0.5, 0.0]
    seq_adv = [1.0, 1.0, -1.0, 2.0, 1.0]
    g = torch.Generator().manual_seed(3)
    old = -torch.rand(5, 4, generator=g, dtype=torch.float64) * 2
    noise = torch.randn(5, 4, generator=g, dtype=torch.float64) * 0.1
    log_ratio = torch.zeros(5, 4, dtype=torch.float64)
    for b in range(5):
        valid = [t for t in range(4) if mask[b, t]]
        if valid:  # token log-ratios vary, but their mean is exactly the chosen value
            centred = noise[b, valid] - noise[b, valid].mean()
            log_ratio[b, valid] = mean_log_ratio[b] + centred
    lp = (old + log_ratio).requires_grad_(True)
    adv = torch.tensor(seq_adv, dtype=torch.float64)[:, None].expand(5, 4).clone()
    return old, lp, adv, mask, mean_log_ratio, seq_adv


def test_gspo_gradient_equals_analytic_and_sequence_objective():
    old, lp, adv, mask, mean_log_ratio, seq_adv = _gspo_setup()
    loss, m = gspo_loss(old, lp, adv, mask, "seq-mean-token-mean", 0.2, 0.2)
    loss.backward()
    n_seq = 4
    ref_loss = 0.0
    for b in range(5):
        length = int(mask[b].sum())
        if not length:
            assert lp.grad[b].abs().max().item() == 0.0
            continue
        s, a = math.exp(mean_log_ratio[b]), seq_adv[b]
        clipped = (a > 0 and s > 1.2) or (a < 0 and s < 0.8)
        ref_loss += max(-a * s, -a * min(max(s, 0.8), 1.2)) / n_seq
        for t in range(4):
            # d/dlogp_t of -A * exp(mean_t log r) = -A * s / |y|, shared by every token of the sequence
            want = 0.0 if clipped or not mask[b, t] else -a * s / (length * n_seq)
            assert lp.grad[b, t].item() == pytest.approx(want, abs=1e-12), (b, t)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-9)
    assert m["pg_clipfrac_upper"].item() == pytest.approx(2 / 12)  # row 1: 2 tokens
    assert m["pg_clipfrac_lower"].item() == pytest.approx(4 / 12)  # row 2: 4 tokens

    # The same gradient from autograd through the plain sequence-level objective.
    lp2 = lp.detach().clone().requires_grad_(True)
    lengths = mask.sum(-1)
    keep = lengths > 0
    s = torch.exp(torch.where(mask, lp2 - old, 0.0).sum(-1)[keep] / lengths[keep])
    a = torch.tensor(seq_adv, dtype=torch.float64)[keep]
    torch.maximum(-a * s, -a * s.clamp(0.8, 1.2)).mean().backward()
    assert torch.allclose(lp.grad, lp2.grad, rtol=1e-10, atol=1e-14)


def test_gspo_ignores_clip_ratio_c_and_has_no_dual_metric():
    old, lp, adv, mask, *_ = _gspo_setup()
    a, m = gspo_loss(old, lp, adv, mask, clip_ratio_c=3.0)
    b, _ = gspo_loss(old, lp, adv, mask, clip_ratio_c=None)
    assert a.item() == b.item() and "dual_clip_frac" not in m


# ---------------------------------------------------------------- CISPO

def test_cispo_value_and_gradient_keep_clipped_tokens():
    old, lp, adv = _tensors()
    loss, m = cispo_loss(old, lp, adv, MASK, "token-mean", clip_ratio_low=1.0, clip_ratio_high=0.28)
    loss.backward()
    n = 11
    ref = 0.0
    for b, t in _valid_cells(MASK):
        r, a = CASES[b][t]
        w = min(r, 1.28)  # lower bound 1 - 1.0 = 0: no lower clip
        ref += -a * w * lp[b, t].item() / n
        # the weight is a constant: d/dlogp = -A * w, also for clipped tokens
        assert lp.grad[b, t].item() == pytest.approx(-a * w / n, abs=1e-12), (b, t)
    assert loss.item() == pytest.approx(ref, rel=1e-9)
    # weights clipped from above: (0,1) r=1.5, (1,1) r=1.5, (1,2) r=5, (2,0), (2,1) r=1e6
    assert m["pg_clipfrac_upper"].item() == pytest.approx(5 / n)
    assert m["pg_clipfrac_lower"].item() == 0.0


def test_all_losses_share_the_signature():
    old, lp, adv = _tensors()
    for name, fn in POLICY_LOSSES.items():
        loss, m = fn(old_log_prob=old, log_prob=lp, advantages=adv, response_mask=MASK, loss_agg_mode="token-mean",
                     clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, rollout_is_weights=None,
                     **OPTIONS.get(name, {}))
        assert loss.dim() == 0
        assert {"pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "ppo_kl"} <= set(m), name


def test_on_policy_ratio_one_gives_minus_mean_advantage():
    adv = torch.tensor([[1.0, -3.0, 2.0]])
    lp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    for name in ("vanilla", "gspo"):
        loss, m = POLICY_LOSSES[name](lp.detach(), lp, adv, torch.ones(1, 3), "token-mean")
        assert loss.item() == pytest.approx(0.0)  # -(1 - 3 + 2) / 3
        assert m["pg_clipfrac"].item() == 0.0 and m["ppo_kl"].item() == 0.0
