"""Bad input to megarl.algo fails loudly with a message naming the argument (no silent broadcasting)."""
import ast
import pathlib
import sys

import pytest
import torch

import megarl.algo

from megarl.algo import (
    ADV_ESTIMATORS,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSSES,
    agg_loss,
    group_ids,
    grpo_advantage,
    lookup,
    masked_mean,
    ppo_clip_loss,
)


def _lp(shape=(4, 8)):
    return torch.zeros(shape)


def test_registries_have_the_contract_names():
    assert {"gae", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax",
            "drgrpo"} <= set(ADV_ESTIMATORS)
    assert {"vanilla", "gspo", "cispo"} <= set(POLICY_LOSSES)
    assert set(LOSS_AGG_MODES) == {"token-mean", "seq-mean-token-sum", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm"}
    assert {"kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"} <= set(KL_ESTIMATORS)


def test_lookup_unknown_name_lists_choices_and_suggests():
    with pytest.raises(ValueError, match=r"unknown adv_estimator 'grp0'.*did you mean 'grpo'"):
        lookup(ADV_ESTIMATORS, "grp0", "adv_estimator")
    assert lookup(POLICY_LOSSES, "gspo", "policy_loss") is POLICY_LOSSES["gspo"]


def test_shape_mismatch_names_both_shapes():
    lp = _lp((4, 8))
    with pytest.raises(ValueError, match=r"response_mask has shape \(4, 7\) but log_prob has shape \(4, 8\); they must match"):
        ppo_clip_loss(lp, lp, lp, torch.ones(4, 7, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"advantages has shape \(4, 1\)"):
        ppo_clip_loss(lp, lp, torch.zeros(4, 1), torch.ones(4, 8))


def test_token_level_inputs_must_be_2d():
    with pytest.raises(ValueError, match=r"log_prob must be \[B, T\] \(2-D\); got shape \(8,\)"):
        ppo_clip_loss(torch.zeros(8), torch.zeros(8), torch.zeros(8), torch.ones(8))


@pytest.mark.parametrize("mask", [torch.ones(2, 3), torch.ones(2, 3, dtype=torch.int64),
                                  torch.ones(2, 3, dtype=torch.bool), torch.tensor([[1, 0, 1], [0, 0, 1]])])
def test_masks_accept_bool_and_0_1_numbers(mask):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    expected = sum(v for v, m in zip(values.flatten().tolist(), mask.flatten().tolist()) if m) / mask.sum().item()
    assert masked_mean(values, mask).item() == pytest.approx(expected)


@pytest.mark.parametrize("mask, pattern", [
    (torch.full((2, 3), 0.5), r"must hold only 0 and 1.*0\.5"),
    (torch.tensor([[1, 2, 0], [0, 1, 1]]), r"must hold only 0 and 1.*found 1 other value\(s\), e\.g\. \[2\]"),
    (torch.ones(2, 3, dtype=torch.complex64), r"dtype torch.complex64"),
])
def test_masks_reject_non_binary_values(mask, pattern):
    with pytest.raises(ValueError, match=pattern):
        masked_mean(torch.ones(2, 3), mask)


def test_masks_must_be_tensors():
    with pytest.raises(ValueError, match="mask must be a torch.Tensor, got list"):
        masked_mean(torch.ones(2, 3), [[1, 1, 1], [1, 1, 1]])


def test_nan_rewards_name_count_and_rows():
    rewards = torch.zeros(5, 3)
    rewards[1, 2] = float("nan")
    rewards[3, 0] = float("inf")
    rewards[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"token_level_rewards has 3 non-finite value\(s\) \(NaN or inf\) in row\(s\) \[1, 3\]"):
        grpo_advantage(token_level_rewards=rewards, response_mask=torch.ones(5, 3), index=[0, 0, 1, 1, 2])


def test_integer_rewards_rejected():
    with pytest.raises(ValueError, match="token_level_rewards must be a floating-point tensor; got dtype torch.int64"):
        grpo_advantage(token_level_rewards=torch.zeros(2, 3, dtype=torch.long), response_mask=torch.ones(2, 3),
                       index=[0, 0])


def test_group_ids_from_strings_and_tensors():
    ids, n = group_ids(["b", "a", "b", "c"], 4)
    assert ids.tolist() == [0, 1, 0, 2] and n == 3
    ids, n = group_ids(torch.tensor([7, 3, 7, 7]), 4)
    assert n == 2 and ids[0] == ids[2] == ids[3] and ids[1] != ids[0]


@pytest.mark.parametrize("index, pattern", [
    (["a", "b"], r"index has 2 entries but the batch has 3 sequences"),
    (torch.tensor([0, 1]), r"index has shape \(2,\) but the batch has 3 sequences"),
    (torch.tensor([0.0, 1.0, 1.0]), r"index must hold integer group ids; got dtype torch.float32"),
    ([[0], [1], [1]], r"index entries must be hashable"),
    (5, r"index must be a \[B\] integer tensor or a sequence of ids; got int"),
])
def test_bad_index(index, pattern):
    with pytest.raises(ValueError, match=pattern):
        group_ids(index, 3)


def test_agg_loss_rejects_unknown_mode_and_bad_denominator():
    with pytest.raises(ValueError, match=r"unknown loss_agg_mode 'token_mean'.*did you mean 'token-mean'"):
        agg_loss(torch.ones(2, 3), torch.ones(2, 3), "token_mean")
    with pytest.raises(ValueError, match=r"denominator=0 is out of range; expected > 0"):
        agg_loss(torch.ones(2, 3), torch.ones(2, 3), "token-mean", denominator=0)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(clip_ratio_low=1.5), r"clip_ratio_low=1.5 is out of range; expected >= 0 and <= 1"),
    (dict(clip_ratio_high=-0.1), r"clip_ratio_high=-0.1 is out of range"),
    (dict(clip_ratio_c=1.0), r"clip_ratio_c=1.0 is out of range; expected > 1"),
])
def test_bad_clip_ranges(kwargs, pattern):
    lp = _lp()
    with pytest.raises(ValueError, match=pattern):
        ppo_clip_loss(lp, lp, lp, torch.ones(4, 8), **kwargs)


def test_algo_imports_only_torch_and_stdlib():
    """megarl.algo stays pure: no megatron, vllm or ray (checked on the source, so no import cost)."""
    allowed = set(sys.stdlib_module_names) | {"torch", "megarl"}
    for path in pathlib.Path(megarl.algo.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                roots = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                roots = [node.module.split(".")[0]]
            else:
                continue
            assert set(roots) <= allowed, f"{path.name} imports {roots}"
