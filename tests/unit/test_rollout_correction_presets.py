"""algorithm.rollout_correction.preset (verl's RolloutCorrectionConfig presets) expands to megarl's settings; IcePop
weights, k3 rejection and verl's rollout_corr/* metric names against values worked out by hand."""
import math
from types import SimpleNamespace

import pytest
import torch

from megarl import steps
from megarl.algo import rollout_is_weights, rollout_mismatch_metrics, rollout_rejection_mask
from megarl.config import ConfigError
from megarl.megatron.losses import PolicyLossSettings
from megarl.validate import load_config

TINY = {"model": {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 2}}}
RC = "algorithm.rollout_correction."

# Each verl preset with its default arguments (verl/trainer/config/algorithm.py), read off verl's definitions:
# rollout_is -> is_level, rollout_is_threshold -> is_threshold ("lower_upper": IcePop -> is_threshold_lower),
# rollout_rs seq_sum_k1 -> sequence, seq_mean_k1 -> geometric, seq_mean_k3 -> seq_mean_k3 (thresholds "lower_upper"),
# bypass_mode -> use_rollout_log_probs, loss_type as is.
GEO = {"rejection_level": "geometric", "rejection_threshold": 1.001, "rejection_threshold_lower": 0.999}
K3 = {"rejection_level": "seq_mean_k3", "rejection_threshold": 0.01}
BYPASS = {"use_rollout_log_probs": True}
PG = {"use_rollout_log_probs": True, "loss_type": "reinforce"}
EXPECTED = {
    "disabled": {},
    "decoupled_token_is": {"is_level": "token", "is_threshold": 2.0},
    "decoupled_seq_is": {"is_level": "sequence", "is_threshold": 2.0},
    "decoupled_token_icepop": {"is_level": "token", "is_threshold": 5.0, "is_threshold_lower": 0.5},
    "decoupled_seq_is_rs": {"is_level": "sequence", "is_threshold": 2.0, "rejection_level": "sequence",
                            "rejection_threshold": 2.0, "rejection_threshold_lower": 0.5},
    "decoupled_geo_rs": GEO,
    "decoupled_geo_rs_seq_tis": {"is_level": "sequence", "is_threshold": 2.0, **GEO},
    "decoupled_geo_rs_token_tis": {"is_level": "token", "is_threshold": 2.0, **GEO},
    "decoupled_k3_rs": K3,
    "decoupled_k3_rs_seq_tis": {"is_level": "sequence", "is_threshold": 2.0, **K3},
    "decoupled_k3_rs_token_tis": {"is_level": "token", "is_threshold": 2.0, **K3},
    "bypass_ppo_clip": BYPASS,
    "bypass_ppo_clip_geo_rs": {**BYPASS, **GEO},
    "bypass_ppo_clip_k3_rs": {**BYPASS, **K3},
    "bypass_pg_is": {"is_level": "sequence", "is_threshold": 2.0, **PG},
    "bypass_pg_token_icepop": {"is_level": "token", "is_threshold": 5.0, "is_threshold_lower": 0.5, **PG},
    "bypass_pg_geo_rs": {**PG, **GEO},
    "bypass_pg_geo_rs_seq_tis": {"is_level": "sequence", "is_threshold": 2.0, **PG, **GEO},
    "bypass_pg_geo_rs_token_tis": {"is_level": "token", "is_threshold": 2.0, **PG, **GEO},
}
OFF = {"is_level": None, "is_threshold": 2.0, "is_threshold_lower": None, "rejection_level": None,
       "use_rollout_log_probs": False, "loss_type": "ppo_clip"}


@pytest.mark.parametrize("preset", sorted(EXPECTED))
def test_preset_expands_to_verls_settings(preset):
    cfg = load_config(data=TINY, overrides=["rollout.n=4", f"{RC}preset={preset}"])
    rc = cfg.algorithm.rollout_correction
    for key, value in {**OFF, **EXPECTED[preset]}.items():
        assert getattr(rc, key) == value, (preset, key)
    # verl's bypass REINFORCE presets train the plain policy gradient with the importance weights (gpg's loss)
    loss = PolicyLossSettings.from_config(cfg, vocab_size=8).policy_loss
    assert loss == ("gpg" if EXPECTED[preset].get("loss_type") == "reinforce" else "vanilla")


def test_preset_conflicts_and_unknown_names_are_refused():
    load_config(data=TINY, overrides=["rollout.n=4", f"{RC}preset=decoupled_token_is", f"{RC}is_threshold=2.0"])
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", f"{RC}preset=decoupled_token_is", f"{RC}is_level=sequence"])
    assert "contradicts preset 'decoupled_token_is'" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", f"{RC}preset=decoupled_tis"])
    assert "decoupled_token_is" in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", f"{RC}preset=bypass_pg_is", "actor.policy_loss=gspo"])
    assert "replaces actor.policy_loss" in str(err.value)


def _pair(ratios, rollout):
    rollout = torch.tensor(rollout, dtype=torch.float64)
    return rollout + torch.tensor(ratios, dtype=torch.float64).log(), rollout


def test_icepop_zeroes_weights_outside_the_band():
    # token ratios 0.4, 1.0, 3.0, 6.0 with the band [0.5, 5]: 0.4 and 6.0 -> 0; the others keep their ratio
    old, rollout = _pair([[0.4, 1.0, 3.0, 6.0]], [[-1.0, -1.0, -1.0, -1.0]])
    w, m = rollout_is_weights(old, rollout, torch.ones(1, 4, dtype=torch.bool), level="token", threshold=5.0,
                              threshold_lower=0.5, mode="mask")
    assert w.flatten().tolist() == pytest.approx([0.0, 1.0, 3.0, 0.0])
    assert m["is_truncated_frac"].item() == 0.5


def test_seq_mean_k3_rejection():
    # k3(r) = r - 1 - ln r. Sequence 0: r = 1.1, 1.0 -> mean (0.1 - ln 1.1) / 2 = 0.002345 (kept at 0.01);
    # sequence 1: r = 1.5 -> 0.5 - ln 1.5 = 0.094535 (rejected)
    old, rollout = _pair([[1.1, 1.0], [1.5, 1.0]], [[-1.0, -1.0], [-1.0, -1.0]])
    mask = torch.tensor([[True, True], [True, False]])
    assert (0.1 - math.log(1.1)) / 2 < 0.01 < 0.5 - math.log(1.5)
    keep, m = rollout_rejection_mask(old, rollout, mask, level="seq_mean_k3", threshold=0.01)
    assert keep.tolist() == [[True, True], [False, False]]
    assert m["rejected_seq_frac"].item() == 0.5 and m["rejected_token_frac"].item() == pytest.approx(1 / 3)


# sequence 0: training log-probs -1, -2, rollout -1.5, -2.5 (log r = 0.5 each); sequence 1: training -1, rollout -1
OLD = torch.tensor([[-1.0, -2.0], [-1.0, 0.0]], dtype=torch.float64)
ROLLOUT = torch.tensor([[-1.5, -2.5], [-1.0, 0.0]], dtype=torch.float64)
MASK2 = torch.tensor([[True, True], [True, False]])


def test_mismatch_metrics_by_hand():
    m = {k: float(v) for k, v in rollout_mismatch_metrics(OLD, ROLLOUT, MASK2).items()}
    # kl = mean over the 3 tokens of (rollout - training) = (-0.5 - 0.5 + 0) / 3
    assert m["mismatch_kl"] == pytest.approx(-1 / 3)
    # log-ppl per sequence: training 1.5 and 1; rollout 2.0 and 1 -> differences -0.5 and 0
    assert m["training_log_ppl"] == pytest.approx(1.25) and m["rollout_log_ppl"] == pytest.approx(1.5)
    assert m["mismatch_log_ppl_diff"] == pytest.approx(-0.25) and m["mismatch_log_ppl_abs_diff"] == pytest.approx(0.25)
    assert m["mismatch_log_ppl_diff_max"] == pytest.approx(0.0) and m["mismatch_log_ppl_diff_min"] == -0.5
    assert m["training_ppl"] == pytest.approx((math.exp(1.5) + math.e) / 2)
    assert m["mismatch_ppl_ratio"] == pytest.approx((math.exp(-0.5) + 1) / 2)
    # chi2 per token: mean of r^2 - 1 = (e + e + 1) / 3 - 1; per sequence: ((e^0.5 e^0.5)^2 + 1) / 2 - 1
    assert m["mismatch_chi2_token"] == pytest.approx((2 * math.e + 1) / 3 - 1)
    assert m["mismatch_chi2_seq"] == pytest.approx((math.exp(2.0) + 1) / 2 - 1)
    # k3 = r - 1 - ln r: (2 (e^0.5 - 1.5) + 0) / 3
    assert m["mismatch_k3_kl"] == pytest.approx(2 * (math.exp(0.5) - 1.5) / 3)


def test_batch_metrics_log_verls_names():
    batch = {"response_mask": MASK2, "old_log_probs": OLD, "rollout_log_probs": ROLLOUT,
             "advantages": torch.zeros(2, 2, dtype=torch.float64)}
    rollout = SimpleNamespace(response_lengths=torch.tensor([2, 1]), truncated=torch.tensor([False, False]),
                              rollout_logprobs=ROLLOUT)
    m = steps.batch_metrics(batch, rollout, torch.tensor([1.0, 0.0]))
    assert m["rollout_corr/kl"] == pytest.approx(-1 / 3)
    assert m["rollout_corr/log_ppl_abs_diff"] == pytest.approx(0.25)
    assert m["rollout_corr/chi2_token"] == pytest.approx((2 * math.e + 1) / 3 - 1)
    assert m["rollout_corr/chi2_seq"] == pytest.approx((math.exp(2.0) + 1) / 2 - 1)
    assert m["rollout_corr/training_ppl"] == pytest.approx((math.exp(1.5) + math.e) / 2)
    # the correction's own metrics under verl's names too: token IS truncated at 2 (r = e^0.5 < 2: kept)
    cfg = load_config(data=TINY, overrides=["rollout.n=4", f"{RC}preset=decoupled_token_is"])
    corr = steps.apply_rollout_correction(cfg, dict(batch))
    assert corr["rollout_corr/rollout_is_mean"] == pytest.approx((2 * math.exp(0.5) + 1) / 3)
    assert corr["rollout_correction/is_weight_mean"] == corr["rollout_corr/rollout_is_mean"]
