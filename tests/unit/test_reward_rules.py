"""Hand-written cases for each registered rule: correct, wrong, malformed."""
import pytest

from megarl.reward import rules
from megarl.reward.rules import last_boxed, normalize_math, normalize_number


@pytest.mark.parametrize("response, truth, expected", [
    ("She pays 3 * 24 = 72 dollars.\n#### 72", "72", 1.0),
    ("#### 1,000", "1000", 1.0),
    ("#### $72.00", "72", 1.0),
    ("so the answer is 72.", "72", 1.0),                    # no '####': the last number
    ("#### 71", "72", 0.0),
    ("#### 72 ... wait, 73", "72", 1.0),                   # the marked answer wins over later numbers
    ("I do not know", "72", 0.0),
    ("", "72", 0.0),
    ("#### 72", "Natalia sold 48/2 = 24 clips.\n#### 72", 1.0),  # ground truth given as a full GSM8K solution
])
def test_gsm8k(response, truth, expected):
    assert rules.gsm8k("openai/gsm8k", response, truth) == expected


def test_gsm8k_strict_and_format_score():
    assert rules.gsm8k("gsm8k", "the answer is 72", "72", strict=True) == 0.0
    assert rules.gsm8k("gsm8k", "#### 70", "72", format_score=0.1) == 0.1
    assert rules.gsm8k("gsm8k", "no number", "72", format_score=0.1) == 0.0


def test_normalize_number():
    assert [normalize_number(x) for x in ["1,000", "$5", "72.0", "3.50", "7.", "-2", "abc", None, "inf"]] == [
        "1000", "5", "72", "3.5", "7", "-2", None, None, None]


@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{5}", "5"),
    (r"\boxed{\frac{1}{2}} and finally \boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}"),  # last, nested braces
    (r"\boxed{{a}+{b}}", "{a}+{b}"),
    (r"$\boxed 7$", "7"),
    (r"\fbox{x}", "x"),
    (r"\boxed{unclosed", None),
    ("no box", None),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize("response, truth, expected", [
    (r"The answer is $\boxed{42}$.", "42", 1.0),
    (r"\boxed{ 42.0 }", "42", 1.0),
    (r"\boxed{\dfrac{1}{2}}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac12}", "1/2", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\left( 1, 2 \right)}", "(1,2)", 1.0),
    (r"\boxed{\text{east}}", "east", 1.0),
    (r"\boxed{43}", "42", 0.0),
    ("42", "42", 0.0),                                     # no box: no answer
    (r"\boxed{42", "42", 0.0),                             # malformed
    (r"\boxed{3}", r"the answer is \boxed{3}", 1.0),       # boxed ground truth
])
def test_math(response, truth, expected):
    assert rules.math("lighteval/MATH", response, truth) == expected


# verl's geo3k rule: 0.9 * acc + 0.1 * format, format = the whole response '<think>...</think>' then text with a box
@pytest.mark.parametrize("response,truth,score", [
    (r"<think>angles sum to 180</think> so x = \boxed{3}", "3", 1.0),
    (r"x = \boxed{3}", "3", 0.9),                                  # right, no thinking
    (r"<think>guess</think> \boxed{4}", "3", 0.1),                  # the format only
    (r"<think>a</think>\boxed{\frac{1}{2}}", "0.5", 1.0),          # equal as numbers
    ("<think>a</think> 3", "3", 0.0),                               # no box: no answer, no format
    (r"preamble <think>a</think> \boxed{3}", "3", 0.9),             # text before <think>: not the format
])
def test_geo3k(response, truth, score):
    out = rules.geo3k("hiyouga/geometry3k", response, truth)
    assert out["score"] == pytest.approx(score) and out["acc"] == (score >= 0.9)


def test_normalize_math_forms():
    assert normalize_math(r"\frac{a+1}{2}") == "(a+1)/2"
    assert normalize_math(r"$ 90^\circ $") == "90"
    assert normalize_math("1,2") == "1,2"  # a list, not the number 12


def test_exact_match():
    assert rules.exact_match("x", "  Paris \n", "Paris") == 1.0
    assert rules.exact_match("x", "paris", "Paris") == 0.0
    assert rules.exact_match("x", "paris", "Paris", case_sensitive=False) == 1.0


def test_format_rules():
    assert rules.format_regex("x", "Answer: 12", None, pattern=r"Answer: \d+") == 1.0
    assert rules.format_regex("x", "so Answer: 12", None, pattern=r"Answer: \d+", fullmatch=True) == 0.0
    good = "<think>2+2 is 4</think>\n<answer>4</answer>"
    assert rules.format_think_answer("x", good) == {"score": 1.0, "format_ok": 1.0}
    assert rules.format_think_answer("x", "<answer>4</answer>")["score"] == 0.0
    assert rules.format_think_answer("x", good + " trailing")["score"] == 0.0
    assert rules.format_think_answer("x", good, "4", check_answer=True) == {"score": 1.0, "format_ok": 1.0, "acc": 1.0}
    assert rules.format_think_answer("x", good, "5", check_answer=True)["score"] == 0.0


@pytest.mark.parametrize("response, expected", [
    ("#### 21", (1.0, 1.0, 1.0)),
    (" 21 ", (1.0, 1.0, 1.0)),
    ("8 + 13 = 21 #### 21", (1.0, 1.0, 1.0)),
    ("#### 20", (0.0, 0.0, 1.0)),
    ("20 21 22", (0.0, 0.0, 0.0)),                           # listing numbers is not an answer
    ("What is", (0.0, 0.0, 0.0)),
    # one answer, ending the response: a sample that runs on past its answer, or lists guesses, to the length cap (no
    # EOS) is not an answer, else GRPO has no reason to keep EOS (the demo drifted to responses at the cap)
    ("#### 1 #### 2 #### 1 #### 21", (0.0, 0.0, 0.0)),
    ("#### #### 21", (0.0, 0.0, 0.0)),
    ("#### 21 21 21 21 21 21 21", (0.0, 0.0, 0.0)),
    ("#### 21 32", (0.0, 0.0, 0.0)),
    ("#### 21 ####", (0.0, 0.0, 0.0)),
    ("#### 21 What is", (0.0, 0.0, 0.0)),
])
def test_arithmetic(response, expected):
    out = rules.arithmetic("arithmetic", response, "21")
    assert (out["score"], out["acc"], out["formatted"]) == expected
    assert rules.arithmetic("arithmetic", "#### 20", "21", format_score=0.1)["score"] == 0.1
