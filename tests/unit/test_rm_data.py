"""Preference pairs from the policy's samples (megarl.rm_data) and the reward model's top-1 accuracy (megarl.rm)."""
import pytest
import torch

from megarl.rm import prompt_groups, top1_accuracy
from megarl.rm_data import pairs_for_prompt, response_text


def test_pairs_pit_the_best_answer_against_the_most_frequent_mistakes_first():
    samples = [("#### 20", 0.0), ("#### 21", 1.0), ("#### 20", 0.0), ("#### 22", 0.0), ("#### 21", 1.0),
               ("#### 20", 0.0), ("7", 0.0)]
    pairs, info = pairs_for_prompt(samples, "#### 21", 1.0, max_pairs=2)
    # "#### 20" was sampled 3 times, "#### 22" and "7" once each: ties in text order ("#### 22" < "7")
    assert pairs == [("#### 21", "#### 20", 1.0, 0.0), ("#### 21", "#### 22", 1.0, 0.0)]
    assert info == {"samples_best": 2}


def test_a_prompt_the_policy_never_gets_right_pairs_the_reference_with_its_mistakes():
    pairs, info = pairs_for_prompt([("#### 5", 0.0), ("#### 6", 0.0), ("#### 5", 0.0)], "#### 9", 1.0, max_pairs=4)
    assert pairs == [("#### 9", "#### 5", 1.0, 0.0), ("#### 9", "#### 6", 1.0, 0.0)]
    assert info == {"samples_best": 0}  # the reference was never sampled


def test_no_pair_when_every_candidate_scores_the_same_or_there_is_no_reference():
    assert pairs_for_prompt([("#### 9", 1.0), ("9", 1.0)], "#### 9", 1.0, max_pairs=4)[0] == []
    assert pairs_for_prompt([("#### 5", 0.0), ("#### 6", 0.0)], None, None, max_pairs=4)[0] == []


def test_graded_scores_pair_only_with_the_best_and_alternate_equal_best_answers():
    # two answers share the best score 0.8 (the first sampled twice): they take turns as the chosen side
    samples = [("b", 0.8), ("a", 0.8), ("b", 0.8), ("c", 0.5), ("d", 0.1), ("d", 0.1)]
    pairs, _ = pairs_for_prompt(samples, None, None, max_pairs=4)
    assert pairs == [("b", "d", 0.8, 0.1), ("a", "c", 0.8, 0.5)]


def test_reference_response_text():
    assert response_text("#### 3") == "#### 3"
    assert response_text([{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"},
                          {"role": "assistant", "content": "#### 3"}]) == "#### 3"
    assert response_text(None) is None


def test_top1_accuracy_by_hand():
    r, w1, w2, s, t = [1], [2], [3], [4], [5]
    # prompt 0: right r against w1 and w2; prompt 1: right s against t
    pairs = [(r, w1), (r, w2), (s, t)]
    groups = prompt_groups([("q0", "r", "w1"), ("q0", "r", "w2"), ([{"role": "user", "content": "q1"}], "s", "t")])
    assert groups == [0, 0, 1]
    # rows: (r, w1), (r, w2), (s, t); prompt 0's best is w2 (0.9 > r's 0.5): a miss; prompt 1's best is s: a hit
    scores = torch.tensor([0.5, 0.2, 0.5, 0.9, 2.0, -1.0])
    assert top1_accuracy(scores, pairs, groups) == pytest.approx(0.5)
    scores = torch.tensor([1.0, 0.2, 1.0, 0.9, 2.0, -1.0])
    assert top1_accuracy(scores, pairs, groups) == pytest.approx(1.0)


def test_validate_refuses_policy_pair_settings_without_enable():
    from megarl.config import ConfigError
    from megarl.validate import load_config

    with pytest.raises(ConfigError) as err:
        load_config("recipes/rm_tiny_cpu.yaml", ["rm.policy_pairs.enable=false", "rm.policy_pairs.n=4",
                                                 "rm.policy_pairs.add_reference=false"])
    text = str(err.value)
    assert "rm.policy_pairs.n = 4" in text and "rm.policy_pairs.add_reference = False" in text
    assert "rm.policy_pairs.enable=true" in text
    assert load_config("recipes/rm_tiny_cpu.yaml", ["rm.policy_pairs.n=4"]).rm.policy_pairs.n == 4  # enabled there
