"""Advantage estimators against hand-derived values and independent Python-loop implementations."""
import math
import statistics

import pytest
import torch

from megarl.algo import ADV_ESTIMATORS

# 5 responses to 3 prompts, right padded; outcome rewards on the last valid token. Row 4 is a group of one.
MASK = torch.tensor([[1, 1, 1, 0],
                     [1, 1, 1, 1],
                     [1, 1, 0, 0],
                     [1, 1, 1, 0],
                     [1, 0, 0, 0]], dtype=torch.bool)
SCORES = [1.0, 0.0, 0.5, 2.0, 3.0]
INDEX = ["p0", "p0", "p1", "p1", "p2"]


def _rewards(scores=SCORES, mask=MASK):
    rewards = torch.zeros(mask.shape, dtype=torch.float64)
    for b, s in enumerate(scores):
        rewards[b, int(mask[b].sum()) - 1] = s
    return rewards


def _valid(mask, b):
    return [t for t in range(mask.shape[1]) if mask[b, t]]


def _whiten_ref(rows_of_values, mask):
    """rows_of_values: dict (b, t) -> value over valid positions; returns whitened dict (unbiased var)."""
    vals = list(rows_of_values.values())
    mean = sum(vals) / len(vals)
    var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
    return {k: (v - mean) / math.sqrt(var + 1e-8) for k, v in rows_of_values.items()}


def _assert_token_matrix(actual, expected_by_pos, mask):
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            want = expected_by_pos.get((b, t), 0.0) if mask[b, t] else 0.0
            assert actual[b, t].item() == pytest.approx(want, abs=1e-9), (b, t)


def _groups(index):
    out = {}
    for b, key in enumerate(index):
        out.setdefault(key, []).append(b)
    return out


# ---------------------------------------------------------------- GRPO / Dr.GRPO

def _grpo_ref(scores, index, norm, eps=1e-6):
    adv = [0.0] * len(scores)
    for members in _groups(index).values():
        if len(members) == 1:
            continue  # a lone sample: no peers, advantage 0
        group = [scores[b] for b in members]
        mean = statistics.mean(group)
        std = statistics.stdev(group)
        for b in members:
            adv[b] = (scores[b] - mean) / (std + eps) if norm else scores[b] - mean
    return adv


@pytest.mark.parametrize("norm", [True, False])
def test_grpo_matches_loop(norm):
    adv, ret = ADV_ESTIMATORS["grpo"](token_level_rewards=_rewards(), response_mask=MASK, index=INDEX,
                                      norm_adv_by_std=norm)
    ref = _grpo_ref(SCORES, INDEX, norm)
    _assert_token_matrix(adv, {(b, t): ref[b] for b in range(5) for t in range(4)}, MASK)
    assert torch.equal(adv, ret)


def test_grpo_hand_values():
    # group p0: scores 1, 0 -> mean 0.5, unbiased std sqrt(0.5); advantages +-0.5/sqrt(0.5) = +-sqrt(0.5)
    adv, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=_rewards(), response_mask=MASK, index=INDEX)
    assert adv[0, 0].item() == pytest.approx(math.sqrt(0.5), rel=1e-5)
    assert adv[1, 3].item() == pytest.approx(-math.sqrt(0.5), rel=1e-5)
    assert adv[4, 0].item() == 0.0  # group of one
    assert adv[0, 3].item() == 0.0  # padding


def test_drgrpo_key_is_grpo_without_std():
    a, _ = ADV_ESTIMATORS["drgrpo"](token_level_rewards=_rewards(), response_mask=MASK, index=INDEX)
    assert a[0, 0].item() == pytest.approx(0.5) and a[2, 0].item() == pytest.approx(-0.75)


def test_grpo_all_equal_rewards_give_zero_and_tensor_index():
    adv, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=_rewards([1.0] * 5), response_mask=MASK,
                                    index=torch.tensor([0, 0, 0, 1, 1]))
    assert adv.abs().max().item() == 0.0


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
@pytest.mark.parametrize("value", [0.7, 0.1, 0.9])
def test_equal_float32_rewards_give_zero_despite_round_off(name, value):
    # float32 mean of sixteen 0.7s is an ulp off; divided by (std ~ 0) + epsilon that used to become ~0.1
    rewards = torch.zeros(16, 3)
    rewards[:, 2] = value
    adv, _ = ADV_ESTIMATORS[name](token_level_rewards=rewards, response_mask=torch.ones(16, 3), index=[0] * 16)
    assert adv.dtype == torch.float32
    assert adv.abs().max().item() < 1e-6


def test_grpo_accepts_float_0_1_mask():
    adv_f, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=_rewards(), response_mask=MASK.double(), index=INDEX)
    adv_b, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=_rewards(), response_mask=MASK, index=INDEX)
    assert torch.equal(adv_f, adv_b)


# ---------------------------------------------------------------- RLOO

def test_rloo_matches_leave_one_out_loop():
    index = ["a", "a", "a", "b", "c"]
    adv, _ = ADV_ESTIMATORS["rloo"](token_level_rewards=_rewards(), response_mask=MASK, index=index)
    ref = [0.0] * 5
    for members in _groups(index).values():
        for b in members:
            others = [SCORES[o] for o in members if o != b]
            ref[b] = SCORES[b] - sum(others) / len(others) if others else 0.0
    _assert_token_matrix(adv, {(b, t): ref[b] for b in range(5) for t in range(4)}, MASK)
    # hand: group a = [1, 0, 0.5]; row 0: 1 - (0 + 0.5)/2 = 0.75
    assert adv[0, 0].item() == pytest.approx(0.75)
    assert adv[4, 0].item() == 0.0 and adv[3, 0].item() == 0.0  # groups of one


# ---------------------------------------------------------------- REINFORCE++

def test_reinforce_pp_matches_loop_with_gamma_and_dense_rewards():
    gamma = 0.9
    rewards = torch.arange(20, dtype=torch.float64).reshape(5, 4) / 10
    mask = MASK.clone()
    mask[1, 1] = False  # a hole inside a response (e.g. tool output): skipped, not a reset
    adv, ret = ADV_ESTIMATORS["reinforce_plus_plus"](token_level_rewards=rewards, response_mask=mask, gamma=gamma)
    returns = {}
    for b in range(5):
        g = 0.0
        for t in reversed(_valid(mask, b)):
            g = rewards[b, t].item() + gamma * g
            returns[(b, t)] = g
    _assert_token_matrix(ret, returns, mask)
    _assert_token_matrix(adv, _whiten_ref(returns, mask), mask)
    # hand: row 1 valid t = 0, 2, 3 with rewards .4, .6, .7: return at t=0 is .4 + .9*(.6 + .9*.7)
    assert ret[1, 0].item() == pytest.approx(0.4 + 0.9 * (0.6 + 0.9 * 0.7))


def test_reinforce_pp_baseline_matches_loop():
    adv, ret = ADV_ESTIMATORS["reinforce_plus_plus_baseline"](token_level_rewards=_rewards(), response_mask=MASK,
                                                              index=INDEX)
    centred = {}
    for members in _groups(INDEX).values():
        mean = sum(SCORES[b] for b in members) / len(members)
        for b in members:
            for t in _valid(MASK, b):
                centred[(b, t)] = SCORES[b] - mean
    _assert_token_matrix(adv, _whiten_ref(centred, MASK), MASK)
    assert torch.equal(adv, ret)


# ---------------------------------------------------------------- ReMax

def test_remax_matches_loop():
    rewards = torch.arange(20, dtype=torch.float64).reshape(5, 4)
    baselines = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=torch.float64)
    adv, ret = ADV_ESTIMATORS["remax"](token_level_rewards=rewards, response_mask=MASK, reward_baselines=baselines)
    returns = {}
    for b in range(5):
        for t in _valid(MASK, b):
            returns[(b, t)] = sum(rewards[b, s].item() for s in _valid(MASK, b) if s >= t)
    _assert_token_matrix(ret, returns, MASK)
    _assert_token_matrix(adv, {k: v - baselines[k[0]].item() for k, v in returns.items()}, MASK)
    assert ret[0, 0].item() == 0 + 1 + 2  # hand: row 0 valid rewards 0, 1, 2


# ---------------------------------------------------------------- GAE

def _gae_ref(rewards, values, mask, gamma, lam):
    adv, ret = {}, {}
    for b in range(mask.shape[0]):
        valid = _valid(mask, b)
        last = 0.0
        for i in reversed(range(len(valid))):
            t = valid[i]
            next_v = values[b, valid[i + 1]].item() if i + 1 < len(valid) else 0.0
            delta = rewards[b, t].item() + gamma * next_v - values[b, t].item()
            last = delta + gamma * lam * last
            adv[(b, t)] = last
            ret[(b, t)] = last + values[b, t].item()
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.9, 0.95), (0.5, 0.0)])
def test_gae_matches_loop(gamma, lam):
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(5, 4, generator=g, dtype=torch.float64)
    values = torch.randn(5, 4, generator=g, dtype=torch.float64)
    values[~MASK] = float("nan")  # padding garbage must not leak into the bootstrap
    mask = MASK.clone()
    mask[1, 2] = False
    adv, ret = ADV_ESTIMATORS["gae"](token_level_rewards=rewards, response_mask=mask, values=values,
                                     gamma=gamma, lam=lam)
    ref_adv, ref_ret = _gae_ref(rewards, torch.nan_to_num(values), mask, gamma, lam)
    _assert_token_matrix(ret, ref_ret, mask)
    _assert_token_matrix(adv, _whiten_ref(ref_adv, mask), mask)
    raw, _ = ADV_ESTIMATORS["gae"](token_level_rewards=rewards, response_mask=mask, values=values,
                                   gamma=gamma, lam=lam, whiten=False)
    _assert_token_matrix(raw, ref_adv, mask)


def test_gae_hand_values():
    # one response of 2 tokens, reward 1 at the end, V = [0.5, 0.25], gamma=lam=1:
    # delta_1 = 1 - 0.25 = 0.75; delta_0 = 0 + 0.25 - 0.5 = -0.25; A_0 = -0.25 + 0.75 = 0.5
    adv, ret = ADV_ESTIMATORS["gae"](token_level_rewards=torch.tensor([[0.0, 1.0, 0.0]]),
                                     response_mask=torch.tensor([[1, 1, 0]]), values=torch.tensor([[0.5, 0.25, 9.0]]),
                                     whiten=False)
    assert adv[0].tolist() == pytest.approx([0.5, 0.75, 0.0])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 0.0])


# ---------------------------------------------------------------- uniform calling convention

def test_every_estimator_accepts_the_union_of_kwargs():
    kwargs = dict(token_level_rewards=_rewards(), response_mask=MASK, index=INDEX,
                  values=torch.zeros(5, 4, dtype=torch.float64), gamma=1.0, lam=1.0, norm_adv_by_std=True,
                  reward_baselines=torch.zeros(5, dtype=torch.float64), epsilon=1e-6,
                  old_log_probs=torch.full((5, 4), -1.0, dtype=torch.float64),
                  sum_pi_squared=torch.full((5, 4), 0.3, dtype=torch.float64))
    for name, fn in ADV_ESTIMATORS.items():
        # pass@k has no second-best in a group of one: give it groups of two or more
        adv, ret = fn(**{**kwargs, "index": ["p0", "p0", "p1", "p1", "p1"]} if name == "grpo_passk" else kwargs)
        assert adv.shape == ret.shape == (5, 4), name
        assert adv[~MASK].abs().max().item() == 0.0, name
        assert torch.isfinite(adv).all(), name
        assert not adv.requires_grad


@pytest.mark.parametrize("name, missing", [("gae", "values"), ("grpo", "index"), ("rloo", "index"),
                                           ("reinforce_plus_plus_baseline", "index"), ("remax", "reward_baselines")])
def test_missing_required_kwarg(name, missing):
    kwargs = dict(token_level_rewards=_rewards(), response_mask=MASK, index=INDEX,
                  values=torch.zeros(5, 4, dtype=torch.float64), reward_baselines=torch.zeros(5, dtype=torch.float64))
    kwargs[missing] = None
    with pytest.raises(ValueError, match=rf"{name} advantage needs \['{missing}'\]"):
        ADV_ESTIMATORS[name](**kwargs)


def test_unknown_kwarg_is_rejected():
    with pytest.raises(ValueError, match=r"unknown keyword\(s\) \['norm_adv_by_std_in_grpo'\]"):
        ADV_ESTIMATORS["grpo"](token_level_rewards=_rewards(), response_mask=MASK, index=INDEX,
                               norm_adv_by_std_in_grpo=False)


def test_values_shape_and_baseline_shape_checked():
    with pytest.raises(ValueError, match=r"values has shape \(5, 3\) but token_level_rewards has shape \(5, 4\)"):
        ADV_ESTIMATORS["gae"](token_level_rewards=_rewards(), response_mask=MASK, values=torch.zeros(5, 3))
    with pytest.raises(ValueError, match=r"reward_baselines must be \[B\] \(1-D\); got shape \(5, 1\)"):
        ADV_ESTIMATORS["remax"](token_level_rewards=_rewards(), response_mask=MASK,
                                reward_baselines=torch.zeros(5, 1))
    with pytest.raises(ValueError, match=r"reward_baselines has shape \(4,\) but the batch has 5 sequences"):
        ADV_ESTIMATORS["remax"](token_level_rewards=_rewards(), response_mask=MASK, reward_baselines=torch.zeros(4))
    with pytest.raises(ValueError, match=r"reward_baselines has 1 non-finite"):
        ADV_ESTIMATORS["remax"](token_level_rewards=_rewards(), response_mask=MASK,
                                reward_baselines=torch.tensor([0.0, float("nan"), 0, 0, 0]))


@pytest.mark.parametrize("name, kwargs, pattern", [
    ("gae", dict(gamma=1.5), r"gamma=1.5 is out of range; expected >= 0 and <= 1"),
    ("gae", dict(lam=-0.1), r"lam=-0.1 is out of range"),
    ("reinforce_plus_plus", dict(gamma=2.0), r"gamma=2.0 is out of range"),
])
def test_discount_ranges_checked(name, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        ADV_ESTIMATORS[name](token_level_rewards=_rewards(), response_mask=MASK,
                             values=torch.zeros(5, 4, dtype=torch.float64), **kwargs)
