"""DAPO extras: overlong reward shaping and the dynamic-sampling group filter."""
import pytest
import torch

from megarl.algo import filter_groups_by_metric, overlong_reward_penalty


def test_overlong_penalty_hand_values():
    # L = 20, buffer C = 4: free up to 16, then -1/4 per token, -1 at 20 and beyond
    lengths = torch.tensor([0, 10, 16, 17, 18, 20, 25])
    penalty, m = overlong_reward_penalty(lengths, max_response_length=20, overlong_buffer_len=4, penalty_factor=1.0)
    assert penalty.tolist() == pytest.approx([0, 0, 0, -0.25, -0.5, -1.0, -1.0])
    assert m["overlong_frac"].item() == pytest.approx(4 / 7)
    assert m["overlong_penalty_mean"].item() == pytest.approx(-2.75 / 7)
    scaled, _ = overlong_reward_penalty(lengths, 20, 4, penalty_factor=0.5)
    assert scaled.tolist() == pytest.approx([0, 0, 0, -0.125, -0.25, -0.5, -0.5])


def test_overlong_penalty_matches_loop():
    max_len, buf, factor = 64, 16, 2.0
    lengths = torch.arange(0, 70)
    penalty, _ = overlong_reward_penalty(lengths, max_len, buf, factor)
    for n, p in zip(lengths.tolist(), penalty.tolist()):
        expected = 0.0
        if n > max_len - buf:
            expected = -factor * min((n - (max_len - buf)) / buf, 1.0)
        assert p == pytest.approx(expected), n


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(max_response_length=20, overlong_buffer_len=0), r"overlong_buffer_len=0 is out of range"),
    (dict(max_response_length=20, overlong_buffer_len=30), r"overlong_buffer_len=30 is out of range; expected > 0 and <= 20"),
    (dict(max_response_length=20, overlong_buffer_len=4, penalty_factor=-1), r"penalty_factor=-1 is out of range"),
])
def test_overlong_bad_arguments(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        overlong_reward_penalty(torch.tensor([1, 2]), **kwargs)


def test_overlong_rejects_token_level_input():
    with pytest.raises(ValueError, match=r"response_lengths must be \[B\] \(1-D\)"):
        overlong_reward_penalty(torch.ones(2, 3), 20, 4)


def test_filter_keeps_only_varied_groups():
    acc = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.5])
    index = ["a", "a", "b", "b", "c", "c", "d", "e", "e"]  # a: varied; b, c: constant; d: single; e: constant
    keep, m = filter_groups_by_metric(acc, index)
    assert keep.tolist() == [True, True, False, False, False, False, False, False, False]
    assert m == {"num_groups": 5, "num_groups_kept": 1, "num_samples_kept": 2}
    keep, m = filter_groups_by_metric(acc, index, keep_singletons=True)
    assert keep.tolist() == [True, True, False, False, False, False, True, False, False]
    assert m["num_groups_kept"] == 2 and m["num_samples_kept"] == 3


def test_filter_matches_loop_on_random_groups():
    g = torch.Generator().manual_seed(0)
    index = torch.randint(0, 6, (40,), generator=g)
    scores = torch.randint(0, 2, (40,), generator=g).float()
    keep, m = filter_groups_by_metric(scores, index)
    groups = {}
    for i, s in zip(index.tolist(), scores.tolist()):
        groups.setdefault(i, set()).add(s)
    for k, i in zip(keep.tolist(), index.tolist()):
        assert k == (len(groups[i]) > 1)
    assert m["num_groups_kept"] == sum(len(v) > 1 for v in groups.values())


def test_filter_all_constant_keeps_nothing_and_nan_is_rejected():
    keep, m = filter_groups_by_metric(torch.ones(4), [0, 0, 1, 1])
    assert not keep.any() and m["num_groups_kept"] == 0
    with pytest.raises(ValueError, match=r"metric_values has 1 non-finite value\(s\) \(NaN or inf\) in row\(s\) \[2\]"):
        filter_groups_by_metric(torch.tensor([0.0, 1.0, float("nan"), 1.0]), [0, 0, 1, 1])
