r"""The `math_dapo` rule against verl's: each expected (score, pred) below was derived by hand from verl's
verl/utils/reward_score/math_dapo.py (volcengine/verl, commit 012542c42542738709ccd0db619cff949cb0337a), following its
steps on the input, not by running megarl's code:

    compute_score(solution_str, ground_truth, strict_box_verify=False)
      solution_str = solution_str[-300:]
      default: re.findall(r"(?i)Answer\s*:\s*([^\n]+)") -> the last match, else "[INVALID]";
               pred = normalize_final_answer(match); correct = pred == normalize_final_answer(ground_truth)
      strict:  the last "\boxed{...}" of solution_str[-100:] (unwrapped), else "[INVALID]"; correct = pred == gt
      returns {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
    normalize_final_answer: split("=")[-1]; SUBSTITUTIONS (.. (" ", ""), ..) then REMOVED_EXPRESSIONS (units ..,
      "\text{}" ..) in order; the first $..$ span; \text{..}, \textbf{..}, \overline{..}, \boxed{..} unwrapped;
      frac12 -> frac{1}{2}, sqrt3 -> sqrt{3}; "$" dropped; a digits-and-commas number loses its commas; strip.

verl is routed here by data_source "math_dapo" (verl/utils/reward_score/__init__.py default_compute_score).
verl's acc is a bool; megarl logs it as 1.0/0.0 (equal in Python: 1.0 == True).
"""
import pytest

from megarl.reward.compute import RewardInput, compute_rewards
from megarl.reward.registry import RewardRouter, get_reward_fn
from megarl.reward.rules import math_dapo

# (response, ground truth, expected score, expected pred, how verl gets there)
CASES = [
    ("So the total is 34.\nAnswer: 34", "34", 1.0, "34", "the Answer: line"),
    ("Answer: 35", "34", -1.0, "35", "wrong"),
    ("The result is 34.", "34", -1.0, "[INVALID]", "no Answer: -> '[INVALID]'"),
    ("Answer: 12\nChecking again...\nAnswer: 34", "34", 1.0, "34", "the last Answer: line"),
    ("answer: 34", "34", 1.0, "34", "(?i): any case"),
    ("ANSWER : 34", "34", 1.0, "34", r"\s* before and after the colon"),
    ("Answer: 34 is my final answer", "34", -1.0, "34ismyfinalanswer", "the rest of the line, spaces removed"),
    ("**Answer:** 34", "34", -1.0, "**34", "markdown bold: the '**' after the colon is kept"),
    (r"Answer: \boxed{34}", "34", 1.0, "34", r"\boxed{..} unwrapped"),
    (r"The answer is \boxed{34}.", "34", -1.0, "[INVALID]", "a box without 'Answer:' is not read (default mode)"),
    ("Answer: 34 dollars", "34", 1.0, "34", "spaces removed, then 'dollars' cut"),
    ("Answer: 12 inches", "12", 1.0, "12", "'12inches' -> 'inches' cut"),
    ("Answer: 30 degrees", "30", 1.0, "30", "'degrees' cut"),
    (r"Answer: 90^\circ", "90", 1.0, "90", r"'^\circ' cut"),
    (r"Answer: 34\text{ cm}", "34", 1.0, "34", r"'34\text{cm}': 'cm' cut, then the empty '\text{}' cut"),
    (r"Answer: \text{(B)}", "(B)", 1.0, "(B)", r"\text{..} unwrapped"),
    (r"Answer: \textbf{7}", "7", 1.0, "7", r"\textbf{..} unwrapped"),
    ("Answer: 1 000", "1000", 1.0, "1000", "spaces removed"),
    ("Answer: 1,000", "1000", 1.0, "1000", "a number with commas loses them"),
    ("Answer: 1{,}000", "1000", 1.0, "1000", "'{,}' cut"),
    ("Answer: 1000", "1,000", 1.0, "1000", "the ground truth is normalised too"),
    ("Answer: $34$", "34", 1.0, "34", "dollars dropped"),
    ("Answer: $34$.", "34", 1.0, "34", "the first $..$ span is kept, so the trailing '.' goes"),
    ("Answer: 34.", "34", -1.0, "34.", "a trailing '.' outside dollars stays"),
    (r"Answer: \$34", "34", 1.0, "34", r"'\$' removed"),
    ("Answer: $x = 5$", "5", 1.0, "5", "what follows the last '=': ' 5$', then '$' dropped"),
    ("Answer: x = 34", "34", 1.0, "34", "what follows the last '='"),
    (r"Answer: \frac12", r"\frac{1}{2}", 1.0, r"\frac{1}{2}", "shorthand frac12 -> frac{1}{2}"),
    (r"Answer: \frac 12", r"\frac{1}{2}", 1.0, r"\frac{1}{2}", "space removed first, then frac12"),
    (r"Answer: \frac{1}{2}", r"\frac{1}{2}", 1.0, r"\frac{1}{2}", "already braced"),
    (r"Answer: \dfrac{1}{2}", r"\frac{1}{2}", -1.0, r"\dfrac{1}{2}", "dfrac is not rewritten"),
    ("Answer: 0.5", r"\frac{1}{2}", -1.0, "0.5", "no numeric equivalence"),
    (r"Answer: 2\sqrt3", r"2\sqrt{3}", 1.0, r"2\sqrt{3}", "shorthand sqrt3 -> sqrt{3}"),
    ("Answer: an integer", "integer", 1.0, "integer", "'an ' cut before the spaces go"),
    ("Answer: -3", "-3", 1.0, "-3", "a negative answer (DAPO-Math-17k has some)"),
]


@pytest.mark.parametrize("response, truth, score, pred, why", CASES, ids=[c[4] for c in CASES])
def test_default_mode_matches_verl(response, truth, score, pred, why):
    out = math_dapo("math_dapo", response, truth)
    assert out == {"score": score, "acc": float(score > 0), "pred": pred}, why


def test_only_the_last_300_characters_are_read():
    answer = "Answer: 34\n"  # 11 characters
    # 11 + 289 = 300: the whole answer line is inside the tail
    assert math_dapo("math_dapo", answer + "x" * 289, "34")["score"] == 1.0
    # 11 + 290 = 301: the tail starts at 'nswer: 34', which no longer matches
    assert math_dapo("math_dapo", answer + "x" * 290, "34") == {"score": -1.0, "acc": 0.0, "pred": "[INVALID]"}
    # a long reasoning before the answer does not matter
    assert math_dapo("math_dapo", "y" * 5000 + answer, "34")["score"] == 1.0


@pytest.mark.parametrize("response, truth, score, pred", [
    (r"so the result is \boxed{34}", "34", 1.0, "34"),
    (r"\boxed{12} no wait \boxed{34}", "34", 1.0, "34"),                      # the last box
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}", 1.0, r"\frac{1}{2}"),             # nested braces balanced
    (r"\boxed{ 34}", "34", -1.0, " 34"),                                       # no normalisation in strict mode
    ("Answer: 34", "34", -1.0, "[INVALID]"),                                   # the Answer: line is not read
    (r"\boxed{34", "34", -1.0, "[INVALID]"),                                   # never closed
    (r"\boxed{34}" + "z" * 91, "34", -1.0, "[INVALID]"),                       # 10 + 91 = 101: box starts outside
    (r"\boxed{34}" + "z" * 90, "34", 1.0, "34"),                               # 10 + 90 = 100: inside
])
def test_strict_box_mode_matches_verl(response, truth, score, pred):
    out = math_dapo("math_dapo", response, truth, strict_box_verify=True)
    assert out == {"score": score, "acc": float(score > 0), "pred": pred}


def test_rows_with_data_source_math_dapo_are_routed_to_it():
    assert RewardRouter().resolve("math_dapo") is math_dapo
    assert get_reward_fn("math_dapo") is math_dapo


def test_scored_through_compute_rewards_with_acc_logged_and_pred_kept():
    samples = [RewardInput("math_dapo", "Answer: 34", "34"), RewardInput("math_dapo", "Answer: 7", "34")]
    scores, metrics, _ = compute_rewards(RewardRouter(), samples, timeout_s=30, num_workers=1)
    assert scores == [1.0, -1.0]
    assert metrics["acc"] == [1.0, 0.0] and metrics["pred"] == ["34", "7"]
    # strict_box_verify through reward.reward_kwargs
    scores, _, _ = compute_rewards(get_reward_fn("math_dapo"), [RewardInput("math_dapo", r"\boxed{34}", "34")],
                                   timeout_s=30, num_workers=1, reward_kwargs={"strict_box_verify": True})
    assert scores == [1.0]
