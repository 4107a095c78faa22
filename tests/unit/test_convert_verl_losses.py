"""verl 0.9.1's sapo and geo_mean fix their own aggregation (verl/trainer/ppo/core_algos.py: sapo calls agg_loss with
"seq-mean-token-mean" whatever loss_agg_mode says; geo_mean returns torch.mean over the sequences). A recipe converted
from verl's default loss_agg_mode (token-mean) must compute verl's loss and gradient; the report says why.

verl's two losses are written out below from its code, independently of megarl's, and compared on the same inputs with
the settings the trainer passes (megarl.megatron.losses.PolicyLossSettings of the converted recipe)."""
import pytest
import torch

from megarl import algo, cli
from megarl.config import load_unchecked
from megarl.convert_verl import convert, gather
from megarl.convert_verl.verl_behaviour import VERL_FIXED_AGGREGATION
from megarl.megatron.losses import PolicyLossSettings

AR = "actor_rollout_ref.actor."
# verl divides by (tokens + 1e-8), each sequence having at least one token: each of its per-sequence terms (and each
# gradient entry, a product of such factors) is off by a relative 1e-8 at most (1.5e-8 for geo_mean: its advantage,
# and its ratio's exponent |x| <= 0.5). The terms here are below 4 / tau * |A| <= 5.2 (sapo) and e^0.5 * |A| <= 2.2
# (geo_mean) in magnitude, so a mean of them is off by at most 5.2e-8 (geo_mean's two micro-batch means together by
# 6.6e-8) however they cancel; float64 rounding adds ~1e-15.
LOSS_ABS, GRAD_REL = 1e-7, 1e-7


def verl_agg_seq_mean_token_mean(loss_mat, mask, global_batch_size=None):
    """verl's agg_loss(..., "seq-mean-token-mean", dp_size=1, global_batch_size)."""
    m = mask.to(loss_mat.dtype)
    tokens = m.sum(-1)
    seq_losses = (loss_mat * m).sum(-1) / (tokens + 1e-8)
    seq_mask = (tokens > 0).to(loss_mat.dtype)
    count = seq_mask.sum() if global_batch_size is None else global_batch_size
    return (seq_losses * seq_mask).sum() / count


def verl_sapo(old, log_prob, adv, mask, tau_pos=1.0, tau_neg=1.05, global_batch_size=None):
    """verl 0.9.1 compute_policy_loss_sapo (without rollout-correction weights)."""
    ratio = torch.exp(torch.clamp(log_prob - old, min=-20.0, max=20.0))
    taus = torch.where(adv > 0, torch.as_tensor(tau_pos, dtype=adv.dtype), torch.as_tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    return verl_agg_seq_mean_token_mean(-gates * adv, mask, global_batch_size)


def verl_geo_mean(old, log_prob, adv, mask, clip_low=0.2, clip_high=0.2):
    """verl 0.9.1 compute_policy_loss_geo_mean (without rollout-correction weights)."""
    m = mask.to(log_prob.dtype)
    nkl = log_prob - old
    sgn = torch.sign(adv)
    nkl_min = sgn * torch.min(sgn * nkl, sgn * torch.clamp(nkl, -clip_low, clip_high))
    tokens = m.sum(-1)
    ratio = torch.exp((nkl_min * m).sum(-1) / (tokens + 1e-8))
    advantage = (adv * m).sum(-1) / (tokens + 1e-8)
    return torch.mean(-advantage * ratio)


def _inputs():
    """4 GRPO-style sequences of 6, 2, 4 and 1 tokens (one advantage per sequence, both signs); log-ratios up to
    +-0.5, so verl's default clip (0.2) cuts some geo_mean tokens; padding holds arbitrary finite values."""
    g = torch.Generator().manual_seed(7)
    lengths, width = [6, 2, 4, 1], 6
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
    old = -torch.rand(4, width, generator=g, dtype=torch.float64) * 3
    log_prob = old + (torch.rand(4, width, generator=g, dtype=torch.float64) - 0.5)
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)[:, None].expand(4, width).clone()
    return old, log_prob, adv, mask


def _converted(loss: str, *extra: str):
    inputs = gather([f"{AR}policy_loss.loss_mode={loss}", "actor_rollout_ref.rollout.n=4", *extra], {})
    c = convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer)
    cfg = load_unchecked(data={**c.recipe, "model": {"path": "unused"}})
    return c, PolicyLossSettings.from_config(cfg, vocab_size=8)


def _megarl(s: PolicyLossSettings, old, log_prob, adv, mask, denominator=None):
    """The policy term as megarl.megatron.losses.PolicyLoss calls it."""
    loss, _ = algo.POLICY_LOSSES[s.policy_loss](
        old, log_prob, adv, mask, clip_ratio_low=s.clip_ratio_low, clip_ratio_high=s.clip_ratio_high,
        clip_ratio_c=s.clip_ratio_c, rollout_is_weights=None, **s.loss_options, loss_agg_mode=s.loss_agg_mode,
        denominator=denominator, max_response_length=mask.shape[1])
    return loss


def _loss_and_grad(fn, log_prob):
    leaf = log_prob.clone().requires_grad_(True)
    loss = fn(leaf)
    (grad,) = torch.autograd.grad(loss, leaf)
    return loss.item(), grad


@pytest.mark.parametrize("loss", ["sapo", "geo_mean"])
def test_converted_from_verl_defaults_computes_verls_loss_and_gradient(loss):
    c, s = _converted(loss)
    assert s.policy_loss == loss and s.loss_agg_mode == "seq-mean-token-mean"
    assert (s.clip_ratio_low, s.clip_ratio_high) == (0.2, 0.2)  # verl's defaults
    if loss == "sapo":
        assert s.loss_options == {"tau_pos": 1.0, "tau_neg": 1.05}  # verl's defaults
    old, log_prob, adv, mask = _inputs()
    verl = verl_sapo if loss == "sapo" else verl_geo_mean
    want, want_grad = _loss_and_grad(lambda lp: verl(old, lp, adv, mask), log_prob)
    got, got_grad = _loss_and_grad(lambda lp: _megarl(s, old, lp, adv, mask), log_prob)
    assert got == pytest.approx(want, rel=0, abs=LOSS_ABS)
    assert got_grad.flatten().tolist() == pytest.approx(want_grad.flatten().tolist(), rel=GRAD_REL, abs=1e-15)
    # the conversion matters: verl's own default mode (token-mean) weighs the long sequences more
    token_mean, _ = _loss_and_grad(
        lambda lp: _megarl(PolicyLossSettings(**{**s.__dict__, "loss_agg_mode": "token-mean"}), old, lp, adv, mask),
        log_prob)
    assert abs(token_mean - want) > 0.05
    # the report says what verl does, what megarl sets and why
    line = (f"(verl default) {AR}loss_agg_mode = 'token-mean' -> actor.loss_agg_mode = 'seq-mean-token-mean' "
            f"({VERL_FIXED_AGGREGATION[loss][1]}; megarl's {loss} follows the mode, so the recipe names verl's)")
    assert line in c.mapped
    assert "policy loss seq-mean-token-mean whatever loss_agg_mode says" in line if loss == "sapo" else \
        "mean over sequences" in line


def test_sapo_split_into_micro_batches_is_still_verls():
    """verl divides each micro-batch's sequence sum by the mini-batch's size; megarl by its global denominator (the
    mini-batch's sequence count): the sums over two micro-batches agree too."""
    _, s = _converted("sapo")
    old, log_prob, adv, mask = _inputs()
    parts = (slice(0, 3), slice(3, 4))
    want, want_grad = _loss_and_grad(lambda lp: sum(verl_sapo(old[p], lp[p], adv[p], mask[p], global_batch_size=4)
                                                    for p in parts), log_prob)
    got, got_grad = _loss_and_grad(lambda lp: sum(_megarl(s, old[p], lp[p], adv[p], mask[p], denominator=4.0)
                                                  for p in parts), log_prob)
    assert got == pytest.approx(want, rel=0, abs=LOSS_ABS)
    assert got_grad.flatten().tolist() == pytest.approx(want_grad.flatten().tolist(), rel=GRAD_REL, abs=1e-15)


def test_geo_mean_micro_batches_are_a_reported_difference():
    """verl's geo_mean takes each micro-batch's mean and the micro-batches add up: with two micro-batches of two
    sequences its loss is twice the mean over the mini-batch, megarl's. The report says so."""
    c, s = _converted("geo_mean")
    old, log_prob, adv, mask = _inputs()
    parts = (slice(0, 2), slice(2, 4))
    verl = sum(verl_geo_mean(old[p], log_prob[p], adv[p], mask[p]) for p in parts).item()
    megarl = sum(_megarl(s, old[p], log_prob[p], adv[p], mask[p], denominator=4.0) for p in parts).item()
    assert verl == pytest.approx(2 * megarl, rel=0, abs=LOSS_ABS)
    assert [d for d in c.differs if d.startswith(f"{AR}policy_loss.loss_mode = 'geo_mean': verl 0.9.1 takes "
                                                 "geo_mean's mean over each micro-batch's sequences")]


@pytest.mark.parametrize("loss", ["sapo", "geo_mean"])
def test_kl_and_entropy_terms_keep_verls_mode_in_verl_a_reported_difference(loss):
    """verl aggregates the KL loss and entropy bonus with loss_agg_mode even for sapo/geo_mean; megarl has one mode."""
    c, s = _converted(loss, f"{AR}use_kl_loss=True", f"{AR}entropy_coeff=0.01")
    assert s.loss_agg_mode == "seq-mean-token-mean"
    assert [d for d in c.differs if d.startswith(
        f"{AR}loss_agg_mode = 'token-mean': verl aggregates the KL loss and entropy bonus with it and only {loss}'s "
        "policy term seq-mean-token-mean")]
    c, _ = _converted(loss, f"{AR}loss_agg_mode=seq-mean-token-mean", f"{AR}use_kl_loss=True")
    assert not [d for d in c.differs if "KL loss" in d] and not c.refused  # the user's mode is verl's: nothing moves


@pytest.mark.parametrize("loss", sorted(set(algo.POLICY_LOSSES) - set(VERL_FIXED_AGGREGATION)))
def test_losses_that_follow_the_mode_in_verl_keep_it(loss):
    """Every other verl 0.9.1 policy loss passes loss_agg_mode to agg_loss: the recipe keeps the user's mode."""
    extra = [f"{AR}policy_loss.dro_beta=0.5"] if loss == "dro" else []
    c, s = _converted(loss, f"{AR}loss_agg_mode=seq-mean-token-sum", *extra)
    assert s.loss_agg_mode == "seq-mean-token-sum" and not c.differs and not c.refused


SCRIPT = """#!/usr/bin/env bash
set -xeuo pipefail
LOSS=${LOSS:-sapo}
ACTOR=(
    actor_rollout_ref.actor.policy_loss.loss_mode=${LOSS}
    actor_rollout_ref.actor.ppo_mini_batch_size=4
    actor_rollout_ref.actor.use_kl_loss=False
    actor_rollout_ref.actor.entropy_coeff=0
)
python3 -m verl.trainer.main_ppo --config-name=ppo_megatron_trainer \\
    algorithm.adv_estimator=grpo data.train_batch_size=8 actor_rollout_ref.rollout.n=4 \\
    "${ACTOR[@]}" "$@"
"""


@pytest.mark.parametrize("loss, strict_code", [("sapo", 0), ("geo_mean", 1)])
def test_cli_report_and_strict(tmp_path, capsys, loss, strict_code):
    script = tmp_path / "run_sapo.sh"
    script.write_text(SCRIPT)
    out = tmp_path / "recipe.yaml"
    code = cli.main(["convert-verl", str(script), "--env", f"LOSS={loss}", "--out", str(out), "--strict"])
    err = capsys.readouterr().err
    assert code == strict_code, err  # geo_mean's micro-batch scaling in verl cannot be reproduced: a DIFFERS line
    assert "(verl default) actor_rollout_ref.actor.loss_agg_mode = 'token-mean' -> actor.loss_agg_mode = " \
           "'seq-mean-token-mean' (verl 0.9.1's" in err
    assert ("DIFFERS, converted but trained differently from verl (1):" in err) == (loss == "geo_mean")
    assert "loss_agg_mode: seq-mean-token-mean" in out.read_text()
    assert cli.main(["validate", str(out)]) == 0, capsys.readouterr().err
