"""The advantage estimators and policy losses selectable by verl's names (opo, gpg, grpo_passk, gdpo,
optimal_token_baseline; sapo, gpg, clip_cov, kl_cov, geo_mean, dro, dppo_tv, dppo_kl) against values worked out by
hand in the comments, and `megarl validate` accepting each name."""
import math

import pytest
import torch

from megarl.algo import ADV_ESTIMATORS, POLICY_LOSSES, sum_pi_squared_from_logits
from megarl.config import ConfigError
from megarl.validate import load_config

L = math.log


def _outcome(scores, lengths, width):
    """token rewards [B, width] with each score on the last valid token, and the mask."""
    rewards = torch.zeros(len(scores), width, dtype=torch.float64)
    mask = torch.zeros(len(scores), width, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(scores, lengths)):
        mask[b, :n] = True
        rewards[b, n - 1] = s
    return rewards, mask


def _per_seq(adv, mask):
    """The one value each row's valid tokens share (asserting they do)."""
    out = []
    for b in range(adv.shape[0]):
        vals = adv[b][mask[b]].tolist()
        assert all(v == pytest.approx(vals[0]) for v in vals)
        assert (adv[b][~mask[b]] == 0).all()
        out.append(vals[0])
    return out


# ---------------------------------------------------------------------------------------------------------- estimators

def test_opo_length_weighted_baseline():
    # group a: lengths 3, 1 and scores 1, 0 -> baseline (3*1 + 1*0) / 4 = 0.75 -> 0.25, -0.75
    # group b: lengths 2, 2 and scores 0.5, 2 -> baseline 1.25 -> -0.75, 0.75; group c alone -> 0
    rewards, mask = _outcome([1.0, 0.0, 0.5, 2.0, 3.0], [3, 1, 2, 2, 1], 4)
    adv, ret = ADV_ESTIMATORS["opo"](token_level_rewards=rewards, response_mask=mask, index=["a", "a", "b", "b", "c"])
    assert _per_seq(adv, mask) == pytest.approx([0.25, -0.75, -0.75, 0.75, 0.0])
    assert torch.equal(adv, ret)


def test_gpg_rescales_by_the_share_of_nonzero_scores():
    # 4 of 5 scores are non-zero -> alpha = 5 / 4; group means 0.5 and 1.25; group of one -> 0
    rewards, mask = _outcome([1.0, 0.0, 0.5, 2.0, 3.0], [3, 1, 2, 2, 1], 4)
    adv, _ = ADV_ESTIMATORS["gpg"](token_level_rewards=rewards, response_mask=mask, index=[0, 0, 1, 1, 2])
    assert _per_seq(adv, mask) == pytest.approx([0.625, -0.625, -0.9375, 0.9375, 0.0])


def test_grpo_passk_only_the_best_learns():
    # group [1, 0, 3]: the best (3) gets 3 - 1 = 2, over the unbiased std sqrt(((1/3)^2 + (4/3)^2 + (5/3)^2) / 2)
    # = sqrt(7/3); group [2, 2]: a tie, the first gets 2 - 2 = 0
    rewards, mask = _outcome([1.0, 0.0, 3.0, 2.0, 2.0], [2, 2, 1, 3, 3], 3)
    index = [0, 0, 0, 1, 1]
    adv, _ = ADV_ESTIMATORS["grpo_passk"](token_level_rewards=rewards, response_mask=mask, index=index)
    assert _per_seq(adv, mask) == pytest.approx([0, 0, 2 / (math.sqrt(7 / 3) + 1e-6), 0, 0])
    raw, _ = ADV_ESTIMATORS["grpo_passk"](token_level_rewards=rewards, response_mask=mask, index=index,
                                          norm_adv_by_std=False)
    assert _per_seq(raw, mask) == pytest.approx([0, 0, 2.0, 0, 0])
    with pytest.raises(ValueError, match="at least 2 samples per group"):
        ADV_ESTIMATORS["grpo_passk"](token_level_rewards=rewards, response_mask=mask, index=[0, 0, 0, 1, 2])


def test_gdpo_normalises_each_reward_dimension_then_whitens():
    # two groups of two, reward dimensions (1,0),(0,1) and (1,1),(0,0); lengths 2,1,1,1.
    rewards, mask = _outcome([1.0, 1.0, 2.0, 0.0], [2, 1, 1, 1], 2)
    comps = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]])
    index = ["g0", "g0", "g1", "g1"]
    # without std, weights (2, 1): g0 -> 2*0.5 - 0.5 = 0.5 and -0.5; g1 -> 1.5 and -1.5. Over the 5 valid tokens
    # (row 0 has two) the values .5 .5 -.5 1.5 -1.5 have mean 0.1 and unbiased variance 5.2 / 4 = 1.3.
    adv, _ = ADV_ESTIMATORS["gdpo"](token_level_rewards=rewards, response_mask=mask, index=index,
                                    reward_components=comps, reward_weights=[2.0, 1.0], norm_adv_by_std=False)
    expected = [(v - 0.1) / math.sqrt(1.3 + 1e-8) for v in (0.5, -0.5, 1.5, -1.5)]
    assert _per_seq(adv, mask) == pytest.approx(expected)
    # with std: each dimension of a two-sample group is +-0.5 / (sqrt(0.5) + eps) = +-s; g0's dimensions cancel, g1's
    # add up to +-2s. Token values 0 0 0 2s -2s (row 0 has two tokens): mean 0, unbiased variance 8s^2 / 4 = 2s^2,
    # so g1's whitened advantages are +-2s / sqrt(2s^2) = +-sqrt(2).
    adv, _ = ADV_ESTIMATORS["gdpo"](token_level_rewards=rewards, response_mask=mask, index=index,
                                    reward_components=comps)
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    g1 = 2 * s / math.sqrt(2 * s * s + 1e-8)
    assert _per_seq(adv, mask) == pytest.approx([0.0, 0.0, g1, -g1], abs=1e-9)
    assert g1 == pytest.approx(math.sqrt(2), rel=1e-6)
    # GRPO on the summed reward cannot tell g0's two answers apart (both sum to 1): gdpo keeps g1's apart from g0's
    grpo, _ = ADV_ESTIMATORS["grpo"](token_level_rewards=rewards, response_mask=mask, index=index)
    assert _per_seq(grpo, mask)[:2] == pytest.approx([0.0, 0.0])


def test_gdpo_without_components_is_whitened_grpo():
    # one dimension (the outcome): group [1, 0] -> +-sqrt(0.5) each over 1 token; group [2] alone -> 0.
    # tokens: +s, +s (row 0 has 2), -s, 0 -> mean s/4, then whiten
    rewards, mask = _outcome([1.0, 0.0, 2.0], [2, 1, 1], 2)
    adv, _ = ADV_ESTIMATORS["gdpo"](token_level_rewards=rewards, response_mask=mask, index=[0, 0, 1])
    s = 0.5 / (math.sqrt(0.5) + 1e-6)
    vals = [s, s, -s, 0.0]
    mean = sum(vals) / 4
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / 3 + 1e-8)
    assert _per_seq(adv, mask) == pytest.approx([(s - mean) / std, (-s - mean) / std, (0 - mean) / std])


def _otb_inputs():
    # one group of two. Row 0: 3 tokens, pi(y) = 0.5 each, sum pi^2 = 0.5 -> w = 1 - 1 + 0.5 = 0.5, W = .5, 1, 1.5;
    # reward 1 at the end -> G = 1, 1, 1. Row 1: 2 tokens, pi(y) = 0.25, sum pi^2 = 0.25 -> w = 0.75, W = .75, 1.5;
    # reward 0 -> G = 0, 0.
    rewards, mask = _outcome([1.0, 0.0], [3, 2], 3)
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 1.0]], dtype=torch.float64))
    sq = torch.tensor([[0.5, 0.5, 0.5], [0.25, 0.25, 0.0]], dtype=torch.float64)
    return rewards, mask, old, sq


def test_optimal_token_baseline():
    rewards, mask, old, sq = _otb_inputs()
    adv, ret = ADV_ESTIMATORS["optimal_token_baseline"](token_level_rewards=rewards, response_mask=mask,
                                                        index=[7, 7], old_log_probs=old, sum_pi_squared=sq)
    # B_0 = (1 * .5 + 0 * .75) / (.5 + .75) = 0.4; B_1 = (1 * 1) / (1 + 1.5) = 0.4; t = 2: only row 0 is valid and it
    # is strictly the longest -> baseline 0 there.
    assert adv.flatten().tolist() == pytest.approx([0.6, 0.6, 1.0, -0.4, -0.4, 0.0])
    assert ret.flatten().tolist() == pytest.approx([1, 1, 1, 0, 0, 0])
    # with IS weights rho = 1 (row 0), 2 (row 1): row 1's w is scaled by 4 -> W = 3, 6;
    # B_0 = .5 / 3.5 = 1/7, B_1 = 1 / 7
    rho = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]], dtype=torch.float64)
    adv, _ = ADV_ESTIMATORS["optimal_token_baseline"](token_level_rewards=rewards, response_mask=mask, index=[7, 7],
                                                      old_log_probs=old, sum_pi_squared=sq, rollout_is_weights=rho)
    assert adv.flatten().tolist() == pytest.approx([6 / 7, 6 / 7, 1.0, -1 / 7, -1 / 7, 0.0])
    # a group of one learns nothing (no peer to form a baseline from)
    adv, _ = ADV_ESTIMATORS["optimal_token_baseline"](token_level_rewards=rewards, response_mask=mask, index=[1, 2],
                                                      old_log_probs=old, sum_pi_squared=sq)
    assert (adv == 0).all()


def test_sum_pi_squared_from_logits():
    # logits (0, ln 3) -> p = (1/4, 3/4) -> 1/16 + 9/16 = 0.625; uniform over 4 -> 4 * 1/16 = 0.25
    logits = torch.tensor([[0.0, math.log(3.0), -math.inf, -math.inf], [1.0, 1.0, 1.0, 1.0]])
    assert sum_pi_squared_from_logits(logits).tolist() == pytest.approx([0.625, 0.25])


# -------------------------------------------------------------------------------------------------------------- losses

def _loss(name, old, new, adv, mask=None, **kw):
    """(loss, metrics, d loss / d log_prob) for one call."""
    log_prob = torch.tensor(new, dtype=torch.float64).requires_grad_(True)
    old = torch.tensor(old, dtype=torch.float64)
    adv = torch.tensor(adv, dtype=torch.float64)
    mask = torch.ones_like(adv, dtype=torch.bool) if mask is None else torch.tensor(mask, dtype=torch.bool)
    loss, metrics = POLICY_LOSSES[name](old, log_prob, adv, mask, **kw)
    loss.backward()
    return loss.item(), {k: float(v) for k, v in metrics.items()}, log_prob.grad


def test_sapo_soft_gate():
    # r = 1.5 with A = 1 (tau 1): -sigmoid(0.5) * 4; r = 0.5 with A = -1 (tau 1.05): +sigmoid(-0.525) * 4 / 1.05
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    loss, m, _ = _loss("sapo", [[L(0.5), L(0.5)]], [[L(0.75), L(0.25)]], [[1.0, -1.0]])
    assert loss == pytest.approx((-sig(0.5) * 4 + sig(-0.525) * 4 / 1.05) / 2)
    assert m["pg_clipfrac"] == 0
    # on-policy (r = 1) the gate's slope is 4 * sigmoid(0) * (1 - sigmoid(0)) = 1: the plain policy gradient -A / n
    _, _, grad = _loss("sapo", [[L(0.5), L(0.3)]], [[L(0.5), L(0.3)]], [[2.0, -1.0]], tau_pos=3.0, tau_neg=7.0)
    assert grad.flatten().tolist() == pytest.approx([-1.0, 0.5])


def test_gpg_plain_policy_gradient():
    # -A log p: -(1)(ln .5) and -(-2)(ln .25), token-mean; the gradient -A / 2 whatever the old policy
    loss, _, grad = _loss("gpg", [[L(0.9), L(0.1)]], [[L(0.5), L(0.25)]], [[1.0, -2.0]])
    assert loss == pytest.approx((-L(0.5) + 2 * L(0.25)) / 2)
    assert grad.flatten().tolist() == pytest.approx([-0.5, 1.0])


# four tokens, A = 2, -2, 2, -2 (mean 0). log p = -0.1, -3, -3, -0.1 (mean -1.55): the centred products are
# 2 * 1.45 = 2.9, -2 * -1.45 = 2.9, -2.9, -2.9: tokens 0 and 1 lie in clip_cov's (1, 5).
COV_ADV = [[2.0, -2.0, 2.0, -2.0]]
COV_LP = [[-0.1, -3.0, -3.0, -0.1]]


def test_clip_cov_detaches_high_covariance_tokens():
    # on-policy (r = 1, nothing PPO-clipped); ratio 0.5 of 4 tokens -> budget 2 -> both candidates detached
    loss, m, grad = _loss("clip_cov", COV_LP, COV_LP, COV_ADV, clip_cov_ratio=0.5)
    assert loss == pytest.approx((0 + 0 - 2 + 2) / 4)
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.5, 0.5])
    assert m["cov_clipfrac"] == 0.5 and m["pg_clipfrac"] == 0.5
    # budget max(1, int(0.25 * 4)) = 1: exactly one of the two candidates, drawn at random
    _, m, grad = _loss("clip_cov", COV_LP, COV_LP, COV_ADV, clip_cov_ratio=0.25,
                       generator=torch.Generator().manual_seed(0))
    assert m["cov_clipfrac"] == 0.25
    assert grad[0, 2:].tolist() == pytest.approx([-0.5, 0.5]) and int((grad[0, :2] == 0).sum()) == 1
    # a token the PPO clip already cut is not a candidate: token 0 at r = e^0.5 > 1.2 with A > 0
    old = [[-0.6, -3.0, -3.0, -0.1]]
    _, m, grad = _loss("clip_cov", old, COV_LP, COV_ADV, clip_cov_ratio=0.5)
    assert grad.flatten().tolist() == pytest.approx([0.0, 0.0, -0.5, 0.5])  # token 0 by the clip, token 1 by covariance
    assert m["cov_clipfrac"] == 0.25 and m["pg_clipfrac_upper"] == 0.25 and m["pg_clipfrac"] == 0.5


def test_kl_cov_penalises_the_top_covariance_token():
    # log p = -0.1, -3, -3, -0.5 (mean -1.65): products 3.1, 2.7, -2.7, -2.3 -> top 1 of 4 (ratio 0.25) is token 0.
    # token 0 has log r = 0.2: -2 e^0.2 + 0.1 * 0.2; the others are on-policy: -A = 2, -2, 2.
    lp = [[-0.1, -3.0, -3.0, -0.5]]
    old = [[-0.3, -3.0, -3.0, -0.5]]
    loss, m, grad = _loss("kl_cov", old, lp, COV_ADV, kl_cov_ratio=0.25, ppo_kl_coef=0.1)
    assert loss == pytest.approx((-2 * math.exp(0.2) + 0.02 + 2 - 2 + 2) / 4)
    assert m["kl_cov_frac"] == 0.25
    # d/dlogp of -A r + c |log r| at token 0: -2 e^0.2 + 0.1
    assert grad[0, 0].item() == pytest.approx((-2 * math.exp(0.2) + 0.1) / 4)


def test_geo_mean_clips_log_ratios_pessimistically():
    # seq 0, A = 1: log r = 0.5, -0.1 -> min with the clamp (0.4, -0.1) -> mean 0.15 -> loss -e^0.15
    # seq 1, A = -1: log r = 0.5, -0.6 -> max with the clamp (0.5, -0.4) -> mean 0.05 -> loss +e^0.05
    old = [[0.0, 0.0], [0.0, 0.0]]
    new = [[0.5, -0.1], [0.5, -0.6]]
    loss, m, grad = _loss("geo_mean", [[o - 1 for o in r] for r in old], [[n - 1 for n in r] for r in new],
                          [[1.0, 1.0], [-1.0, -1.0]], clip_ratio_low=0.4, clip_ratio_high=0.4)
    assert loss == pytest.approx((-math.exp(0.15) + math.exp(0.05)) / 2)
    # clamped token 0 of seq 0 has no gradient; token 1: -1 * e^0.15 * 1/2 (mean over 2 tokens) / 2 sequences
    assert grad[0].tolist() == pytest.approx([0.0, -math.exp(0.15) / 4])
    # seq 1: token 0 (0.5 kept, above the clamp) has gradient e^0.05 / 4; token 1 is held at the clamp -0.4
    assert grad[1].tolist() == pytest.approx([math.exp(0.05) / 4, 0.0])
    assert m["pg_clipfrac_upper"] == 0.25 and m["pg_clipfrac_lower"] == 0.5


def test_dro_quadratic_penalty():
    # -(A log p - beta/2 (log r)^2) with A = 1, p = .5, log r = 0.2, beta = 0.5 -> ln 2 + 0.01;
    # gradient -(A - beta log r) = -0.9
    loss, _, grad = _loss("dro", [[L(0.5) - 0.2]], [[L(0.5)]], [[1.0]], dro_beta=0.5)
    assert loss == pytest.approx(L(2) + 0.01)
    assert grad.item() == pytest.approx(-0.9)
    with pytest.raises(ValueError, match="dro_beta"):
        _loss("dro", [[0.0]], [[0.0]], [[1.0]])


def test_dppo_tv_masks_tokens_past_the_probability_bound():
    # p_old = .5 everywhere. A > 0: p .7 (moved +.2 > .15: out), p .6 (+.1: in, r = 1.2);
    # A < 0: p .3 (-.2 < -.15: out), p .45 (in, r = .9)
    old = [[L(0.5)] * 4]
    new = [[L(0.7), L(0.6), L(0.3), L(0.45)]]
    adv = [[1.0, 1.0, -1.0, -1.0]]
    loss, m, grad = _loss("dppo_tv", old, new, adv, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=20.0)
    assert loss == pytest.approx((-1.2 * L(0.6) + 0.9 * L(0.45)) / 4)
    assert grad.flatten().tolist() == pytest.approx([0.0, -1.2 / 4, 0.0, 0.9 / 4])
    assert m["pg_clipfrac"] == 0.5 and m["pg_clipfrac_upper"] == 0.25 and m["pg_clipfrac_lower"] == 0.25
    # the importance weight is truncated at clip_ratio_c: 1.2 -> 1.1
    _, m, grad = _loss("dppo_tv", old, new, adv, clip_ratio_low=0.15, clip_ratio_high=0.15, clip_ratio_c=1.1)
    assert grad[0, 1].item() == pytest.approx(-1.1 / 4) and m["truncated_frac"] == 0.25


def test_dppo_kl_bounds_the_binary_kl_in_the_advantage_direction():
    # p_old = .5. Binary KL of p = .7 (or .3): .5 ln(.5/.7) + .5 ln(.5/.3) ~ 0.0872 > 0.05.
    # A > 0: p .7 moves up past the bound (out); p .4 moves down (always in, r = .8).
    # A < 0: p .3 moves down past the bound (out); p .6 moves up (always in, r = 1.2).
    d = 0.5 * L(0.5 / 0.7) + 0.5 * L(0.5 / 0.3)
    assert d > 0.05
    old = [[L(0.5)] * 4]
    new = [[L(0.7), L(0.4), L(0.3), L(0.6)]]
    adv = [[1.0, 1.0, -1.0, -1.0]]
    loss, m, grad = _loss("dppo_kl", old, new, adv, clip_ratio_low=0.05, clip_ratio_high=0.05, clip_ratio_c=20.0)
    assert loss == pytest.approx((-0.8 * L(0.4) + 1.2 * L(0.6)) / 4)
    assert grad.flatten().tolist() == pytest.approx([0.0, -0.8 / 4, 0.0, 1.2 / 4])
    assert m["pg_clipfrac"] == 0.5
    # a looser bound (0.1 > 0.0872) keeps every token
    _, m, _ = _loss("dppo_kl", old, new, adv, clip_ratio_low=0.1, clip_ratio_high=0.1, clip_ratio_c=20.0)
    assert m["pg_clipfrac"] == 0.0


# -------------------------------------------------------------------------------------------------------------- config

TINY = {"model": {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 2}}}


@pytest.mark.parametrize("name", ["opo", "gpg", "grpo_passk", "gdpo", "optimal_token_baseline"])
def test_validate_accepts_each_estimator(name):
    assert load_config(data=TINY, overrides=["rollout.n=4", f"algorithm.adv_estimator={name}"]) is not None


@pytest.mark.parametrize("name", ["sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl"])
def test_validate_accepts_each_policy_loss(name):
    assert load_config(data=TINY, overrides=["rollout.n=4", f"actor.policy_loss={name}"]) is not None


def test_loss_options_are_read_only_by_their_loss():
    load_config(data=TINY, overrides=["rollout.n=4", "actor.policy_loss=dro", "actor.policy_loss_options.dro_beta=0.1"])
    load_config(data=TINY, overrides=["rollout.n=4", "actor.policy_loss=sapo", "actor.policy_loss_options.tau_neg=2.0"])
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", "actor.policy_loss=dro"])
    assert "set actor.policy_loss_options.dro_beta" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", "actor.policy_loss=vanilla",
                                          "actor.policy_loss_options.tau_neg=2.0"])
    assert "only policy_loss ['sapo'] reads it" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", "algorithm.adv_estimator=gdpo",
                                          "algorithm.gdpo_reward_keys=[acc,format]",
                                          "algorithm.gdpo_reward_weights=[1.0]"])
    assert "one weight per reward dimension" in str(err.value)
