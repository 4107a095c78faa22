"""Value loss, explained variance, KL estimators, KL-in-reward and KL controllers."""
import math

import pytest
import torch

from megarl.algo import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    explained_variance,
    kl_loss,
    kl_penalty,
    value_loss,
)

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)


# ---------------------------------------------------------------- value loss

def test_value_loss_matches_loop_and_clipped_gradient_is_zero():
    vpreds = torch.tensor([[0.5, 2.0, -1.0], [1.0, 0.0, 7.0]], dtype=torch.float64, requires_grad=True)
    values = torch.tensor([[0.0, 1.0, 0.0], [1.05, 0.0, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[1.0, 0.0, -2.0], [2.0, 0.3, 0.0]], dtype=torch.float64)
    clip = 0.2
    loss, m = value_loss(vpreds, returns=returns, values=values, response_mask=MASK, cliprange_value=clip)
    cells = [(b, t) for b in range(2) for t in range(3) if MASK[b, t]]
    ref, clipped_count, grads = 0.0, 0, {}
    for b, t in cells:
        v, old, ret = vpreds[b, t].item(), values[b, t].item(), returns[b, t].item()
        vclip = old + min(max(v - old, -clip), clip)
        l1, l2 = (v - ret) ** 2, (vclip - ret) ** 2
        ref += 0.5 * max(l1, l2) / len(cells)
        clipped_count += l2 > l1
        # the clipped branch is constant in v once v is outside the clip window
        grads[(b, t)] = (v - ret) / len(cells) if l1 >= l2 else (0.0 if abs(v - old) > clip else (vclip - ret) / len(cells))
    assert loss.item() == pytest.approx(ref)
    assert m["vf_clipfrac"].item() == pytest.approx(clipped_count / len(cells))
    assert clipped_count > 0
    loss.backward()
    for (b, t), g in grads.items():
        assert vpreds.grad[b, t].item() == pytest.approx(g), (b, t)
    assert vpreds.grad[1, 2].item() == 0.0


def test_value_loss_hand_value_and_no_clip():
    # vpred 2, old value 0, return 0: unclipped (2 - 0)^2 = 4, clipped (0.2 - 0)^2 = 0.04 -> 0.5 * 4
    vp, v, r = torch.tensor([[2.0]]), torch.tensor([[0.0]]), torch.tensor([[0.0]])
    assert value_loss(vp, r, v, torch.ones(1, 1), 0.2)[0].item() == pytest.approx(2.0)
    # returns 3: unclipped (2-3)^2 = 1, clipped (0.2-3)^2 = 7.84 -> 0.5 * 7.84
    assert value_loss(vp, torch.tensor([[3.0]]), v, torch.ones(1, 1), 0.2)[0].item() == pytest.approx(3.92)
    assert value_loss(vp, torch.tensor([[3.0]]), v, torch.ones(1, 1), None)[0].item() == pytest.approx(0.5)


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    assert explained_variance(returns, returns, MASK).item() == pytest.approx(1.0)
    mean = torch.full_like(returns, 3.0)
    assert explained_variance(mean, returns, MASK).item() == pytest.approx(0.0, abs=1e-6)
    # values = returns - 1: the residual is constant, Var 0 -> EV 1
    assert explained_variance(returns - 1, returns, MASK).item() == pytest.approx(1.0)
    # values = 0: Var[r - 0] / Var[r] = 1 -> EV 0
    assert explained_variance(torch.zeros_like(returns), returns, MASK).item() == pytest.approx(0.0, abs=1e-6)
    assert math.isnan(explained_variance(returns, torch.ones_like(returns), MASK).item())


# ---------------------------------------------------------------- KL estimators

@pytest.mark.parametrize("name, ref", [
    ("kl", lambda x: x), ("k1", lambda x: x), ("abs", abs), ("mse", lambda x: 0.5 * x * x),
    ("k2", lambda x: 0.5 * x * x),
    ("low_var_kl", lambda x: min(math.exp(-x) + x - 1, 10.0)), ("k3", lambda x: min(math.exp(-x) + x - 1, 10.0)),
])
def test_kl_estimators_per_token(name, ref):
    xs = [-30.0, -2.0, -0.1, 0.0, 0.3, 5.0, 40.0]  # x = log_prob - ref_log_prob
    ref_lp = torch.full((1, len(xs)), -1.0, dtype=torch.float64)
    lp = ref_lp + torch.tensor([xs], dtype=torch.float64)
    out = kl_penalty(lp, ref_lp, name)
    for i, x in enumerate(xs):
        assert out[0, i].item() == pytest.approx(ref(x), rel=1e-9, abs=1e-12), (name, x)
    assert KL_ESTIMATORS[name](lp, ref_lp).shape == lp.shape


def test_k3_hand_value_and_gradient():
    # x = log 2: k3 = e^{-x} + x - 1 = 0.5 + ln 2 - 1; d/dx = 1 - e^{-x} = 0.5
    lp = torch.tensor([[math.log(2.0)]], dtype=torch.float64, requires_grad=True)
    out = kl_penalty(lp, torch.zeros(1, 1, dtype=torch.float64), "low_var_kl")
    assert out.item() == pytest.approx(math.log(2.0) - 0.5)
    out.sum().backward()
    assert lp.grad.item() == pytest.approx(0.5)


def test_kl_loss_aggregates_masked():
    lp = torch.tensor([[0.0, 1.0, 2.0], [0.0, 3.0, float("nan")]], requires_grad=True)
    ref = torch.zeros(2, 3)
    loss, m = kl_loss(lp, ref, MASK, "kl", "token-mean")
    assert loss.item() == pytest.approx((0 + 1 + 2 + 0 + 3) / 5)
    assert m["kl_loss"].item() == pytest.approx(loss.item())


def test_kl_unknown_type_and_shape_errors():
    with pytest.raises(ValueError, match=r"unknown kl_penalty_type 'lowvar_kl'.*did you mean 'low_var_kl'"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 2), "lowvar_kl")
    with pytest.raises(ValueError, match=r"ref_log_prob has shape \(1, 3\) but log_prob has shape \(1, 2\)"):
        kl_penalty(torch.zeros(1, 2), torch.zeros(1, 3))


# ---------------------------------------------------------------- KL in reward and controllers

def test_apply_kl_penalty_matches_loop():
    scores = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    lp = torch.tensor([[-1.0, -0.5, -0.2], [-0.3, -0.1, 5.0]])
    ref_lp = torch.tensor([[-1.2, -0.5, -0.1], [-0.1, -0.4, -9.0]])
    rewards, m = apply_kl_penalty(scores, lp, ref_lp, MASK, kl_coef=0.1, kl_penalty_type="kl")
    per_seq = []
    for b in range(2):
        kls = []
        for t in range(3):
            kl = lp[b, t].item() - ref_lp[b, t].item() if MASK[b, t] else 0.0
            assert rewards[b, t].item() == pytest.approx(scores[b, t].item() - 0.1 * kl)
            if MASK[b, t]:
                kls.append(kl)
        per_seq.append(sum(kls) / len(kls))
    assert m["kl"].item() == pytest.approx(sum(per_seq) / 2)
    assert m["kl_coef"].item() == pytest.approx(0.1)


def test_apply_kl_penalty_rejects_nan_scores():
    scores = torch.tensor([[0.0, float("nan"), 1.0], [0.0, 2.0, 0.0]])
    with pytest.raises(ValueError, match=r"token_level_scores has 1 non-finite value\(s\).*row\(s\) \[0\]"):
        apply_kl_penalty(scores, torch.zeros(2, 3), torch.zeros(2, 3), MASK, 0.1)


def test_fixed_controller():
    ctl = FixedKLController(0.05)
    ctl.update(current_kl=10.0, n_steps=256)
    assert ctl.value == 0.05


def test_adaptive_controller_hand_values():
    ctl = AdaptiveKLController(init_kl_coef=0.2, target_kl=6.0, horizon=10000)
    ctl.update(current_kl=9.0, n_steps=100)  # error = 9/6 - 1 = 0.5 -> clipped to 0.2
    assert ctl.value == pytest.approx(0.2 * (1 + 0.2 * 100 / 10000))
    before = ctl.value
    ctl.update(current_kl=5.7, n_steps=1000)  # error = -0.05
    assert ctl.value == pytest.approx(before * (1 - 0.05 * 1000 / 10000))
    restored = AdaptiveKLController(0.2, 6.0, 10000)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match=r"target_kl=0 is out of range; expected > 0"):
        AdaptiveKLController(0.2, 0, 10000)
