"""Rule-based reward functions, all with the uniform signature

    fn(data_source, solution_str, ground_truth, extra_info=None, **reward_kwargs) -> float | dict

Answer extraction and normalisation are separate small functions so they can be tested (and reused) on their own.
"""
from __future__ import annotations

import math as _math
import re
from typing import Any, Optional

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")
_HASH_ANSWER = re.compile(r"####\s*(-?[$\d,.]*\d)")


# ----------------------------------------------------------------------------------------------------------------------
# Numbers (GSM8K style)


def normalize_number(text: Any) -> Optional[str]:
    """'1,000' -> '1000', '$5' -> '5', '72.0' -> '72', '3.50' -> '3.5', '7.' -> '7'; None if it is not a number."""
    if text is None:
        return None
    s = str(text).strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = float(s)
    except ValueError:
        return None
    if not _math.isfinite(value):
        return None
    if value == int(value) and abs(value) < 1e15:
        return str(int(value))
    return repr(value)


def extract_hash_answer(text: str) -> Optional[str]:
    """The number after the last '####' (GSM8K's answer marker), or None."""
    found = _HASH_ANSWER.findall(text)
    return found[-1] if found else None


def extract_last_number(text: str) -> Optional[str]:
    found = [m for m in _NUMBER.findall(text) if any(c.isdigit() for c in m)]
    return found[-1] if found else None


def gsm8k(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
          strict: bool = False, format_score: float = 0.0, score: float = 1.0) -> float:
    """1.0 if the final answer equals the ground truth as a number.

    The answer is the number after the last '####'; without one, the last number in the text unless strict=True.
    format_score: given to an answer that was found but is wrong (e.g. 0.1 to reward the format early in training).
    The ground truth may itself be a GSM8K solution ending in '#### N'.
    """
    answer = extract_hash_answer(solution_str)
    if answer is None and not strict:
        answer = extract_last_number(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = extract_hash_answer(truth) or truth
    expected = normalize_number(truth)
    got = normalize_number(answer)
    if got is not None and got == expected:
        return score
    return format_score


# ----------------------------------------------------------------------------------------------------------------------
# LaTeX answers (MATH style)


def last_boxed(text: str) -> Optional[str]:
    r"""Content of the last \boxed{...} (or \fbox{...}) with balanced braces; also '\boxed 5'.
    None if there is none or it is not closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start:]
    rest = rest[len("\\boxed"):] if rest.startswith("\\boxed") else rest[len("\\fbox"):]
    if rest.startswith(" "):  # '\boxed 5': the argument runs to the next space or '$'
        return re.split(r"[\s$]", rest.lstrip(), maxsplit=1)[0] or None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


_FRAC = re.compile(r"\\frac\{([^{}]+)\}\{([^{}]+)\}")
_FRAC_SHORT = re.compile(r"\\frac(\d)(\d)")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _frac_to_slash(m: re.Match) -> str:
    # parenthesise only compound parts, so \frac{1}{2} -> 1/2 but \frac{a+1}{2} -> (a+1)/2
    parts = [p if re.fullmatch(r"-?[\w.]+", p) else f"({p})" for p in m.groups()]
    return "/".join(parts)


def normalize_math(answer: str) -> str:
    r"""Simple canonical form: no spaces, '$', '\left'/'\right', '\!', text wrappers or trailing '.';
    \dfrac/\tfrac -> \frac, \frac{a}{b} -> a/b, '\frac12' -> 1/2, '0.50' -> 0.5, '5.0' -> 5."""
    s = str(answer).strip()
    s = _TEXT.sub(r"\1", s)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("$", ""),
                     ("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("^\\circ", ""), ("^{\\circ}", "")):
        s = s.replace(old, new)
    s = re.sub(r"\s+", "", s).rstrip(".")
    s = _FRAC_SHORT.sub(r"\\frac{\1}{\2}", s)
    s = _FRAC.sub(_frac_to_slash, s)
    number = normalize_number(s)
    return number if number is not None and "," not in str(answer) else s


def _fraction_value(s: str) -> Optional[float]:
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)/(-?\d+(?:\.\d+)?)", s)
    if m and float(m.group(2)) != 0:
        return float(m.group(1)) / float(m.group(2))
    try:
        return float(s)
    except ValueError:
        return None


def math_equal(a: str, b: str) -> bool:
    """Equal after normalize_math, or equal as numbers (1/2 == 0.5)."""
    na, nb = normalize_math(a), normalize_math(b)
    if na == nb:
        return True
    va, vb = _fraction_value(na), _fraction_value(nb)
    return va is not None and vb is not None and _math.isclose(va, vb, rel_tol=1e-9, abs_tol=1e-12)


def math(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
         format_score: float = 0.0) -> float:
    r"""1.0 if the last \boxed{...} in the response equals the ground truth (see math_equal), else format_score if a
    boxed answer was found, else 0.0. A ground truth containing \boxed{...} is unboxed first."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    truth = str(ground_truth)
    truth = last_boxed(truth) if "\\boxed" in truth or "\\fbox" in truth else truth
    return 1.0 if truth is not None and math_equal(answer, truth) else format_score


# verl's geo3k rule (Geometry3K, the vision-language GRPO example): thinking in <think> tags, then a boxed answer
_THINK_THEN_BOXED = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def geo3k(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
          format_weight: float = 0.1) -> dict[str, float]:
    r"""verl's Geometry3K score: (1 - format_weight) * acc + format_weight * format, acc 1 when the last \boxed{...}
    equals the ground truth (math_equal: megarl's equivalence, where verl asks mathruler's grade_answer), format 1
    when the whole response is '<think>...</think>' then text holding a \boxed{...}. Metrics: acc, format_ok."""
    answer = last_boxed(solution_str)
    acc = 1.0 if answer is not None and math_equal(answer, str(ground_truth)) else 0.0
    ok = 1.0 if _THINK_THEN_BOXED.fullmatch(solution_str) else 0.0
    return {"score": (1.0 - format_weight) * acc + format_weight * ok, "acc": acc, "format_ok": ok}


# ----------------------------------------------------------------------------------------------------------------------
# DAPO-Math-17k's rule (verl's math_dapo: a final 'Answer: ...' line, +1 right, -1 wrong)

# What verl's math_dapo scores (it reads only the end of a response: the longest MATH-500 answer is 159 characters)
DAPO_TAIL_CHARS = 300
DAPO_STRICT_TAIL_CHARS = 100  # strict_box_verify: the box must lie in the last 100 characters of that
DAPO_INVALID = "[INVALID]"  # the prediction when no answer could be read
_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# normalize_final_answer's two tables, in verl's order (which matters: spaces go before units are cut, so
# '34 dollars' -> '34dollars' -> '34'; 'an '/'a ' are cut while the spaces are still there)
DAPO_SUBSTITUTIONS = [
    ("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
    (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"),
]
DAPO_REMOVED_EXPRESSIONS = [
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
]


def last_boxed_only_string(text: str) -> Optional[str]:
    r"""The last '\boxed{...}' of text, braces balanced, wrapper included; None if there is none or it is not closed.
    Only the braced form ('\boxed 5' and '\fbox' are not read, unlike `last_boxed`)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None


def remove_boxed(boxed: str) -> str:
    r"""'\boxed{x}' -> 'x'; ValueError for anything else."""
    head = "\\boxed{"
    if not (boxed.startswith(head) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} expression: {boxed!r:.100}")
    return boxed[len(head):-1]


def normalize_final_answer(answer: str) -> str:
    r"""verl's (and Minerva's) canonical form of a final answer, step by step:

    1. keep what follows the last '='                       'x = 34' -> ' 34'
    2. DAPO_SUBSTITUTIONS in order (spaces removed, '\$' removed, 'mbox' -> 'text' ...)
    3. DAPO_REMOVED_EXPRESSIONS cut in order (units, '\text{}', degrees, '{,}' ...)
    4. of a '$...$' span keep the first one's inside         'so $34$ m' -> '$34$'
    5. unwrap \text{..}, \textbf{..}, \overline{..} (the first closing brace) and \boxed{..} (the last)
    6. shorthand TeX: 'frac12' -> 'frac{1}{2}', 'sqrt3' -> 'sqrt{3}'; then every '$' dropped
    7. a number written with commas loses them             '1,000' -> '1000'
    8. stripped
    Nothing else: '34.' stays '34.', '\dfrac{1}{2}' is not '\frac{1}{2}', '0.5' is not '\frac{1}{2}'.
    """
    s = answer.split("=")[-1]
    for old, new in DAPO_SUBSTITUTIONS:
        s = s.replace(old, new)
    for expr in DAPO_REMOVED_EXPRESSIONS:
        s = s.replace(expr, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$", s)
    for wrapper in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + wrapper + r"\{)(.*?)(\})", r"\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", r"\2", s)
    s = re.sub(r"(frac)([^{])(.)", r"frac{\2}{\3}", s)
    s = re.sub(r"(sqrt)([^{])", r"sqrt{\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_answer(text: str) -> Optional[str]:
    """The text after the last 'Answer:' (any case, spaces around the colon) up to the end of its line, or None."""
    found = _DAPO_ANSWER.findall(text)
    return found[-1] if found else None


def math_dapo(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
              strict_box_verify: bool = False) -> dict[str, Any]:
    r"""DAPO-Math-17k's reward, verl's `math_dapo.compute_score`: score 1.0 right, -1.0 wrong or unreadable.

    Only the last DAPO_TAIL_CHARS characters of the response are read. Default mode: the answer is the text after
    the last 'Answer:' on its line; it is right when normalize_final_answer of it equals normalize_final_answer of
    the ground truth (no answer: the prediction is '[INVALID]'). strict_box_verify: the answer is the last
    \boxed{...} within the last DAPO_STRICT_TAIL_CHARS of those characters, compared with the ground truth as it is
    (no normalisation). Returns {"score", "acc" (1.0/0.0; verl's True/False), "pred" (the prediction compared)};
    pred is text, so it is kept in the rule's output and left out of the logged means.
    """
    tail = solution_str[-DAPO_TAIL_CHARS:]
    truth = str(ground_truth)
    if strict_box_verify:
        boxed = last_boxed_only_string(tail[-DAPO_STRICT_TAIL_CHARS:])
        pred = remove_boxed(boxed) if boxed is not None else DAPO_INVALID
        correct = pred == truth
    else:
        answer = dapo_answer(tail)
        pred = normalize_final_answer(DAPO_INVALID if answer is None else answer)
        correct = pred == normalize_final_answer(truth)
    return {"score": 1.0 if correct else -1.0, "acc": 1.0 if correct else 0.0, "pred": pred}


# ----------------------------------------------------------------------------------------------------------------------
# Strings and formats


def exact_match(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
                case_sensitive: bool = True) -> float:
    """1.0 if the stripped response equals the stripped ground truth."""
    got, want = solution_str.strip(), str(ground_truth).strip()
    if not case_sensitive:
        got, want = got.lower(), want.lower()
    return 1.0 if got == want else 0.0


def format_regex(data_source: str, solution_str: str, ground_truth: Any = None, extra_info: Optional[dict] = None, *,
                 pattern: str, fullmatch: bool = False, dotall: bool = True) -> float:
    """1.0 if `pattern` (reward_kwargs) matches the response (re.search, or re.fullmatch), else 0.0."""
    regex = re.compile(pattern, re.DOTALL if dotall else 0)
    found = regex.fullmatch(solution_str.strip()) if fullmatch else regex.search(solution_str)
    return 1.0 if found else 0.0


_THINK_ANSWER = re.compile(r"<think>.*?</think>\s*<answer>(.*?)</answer>", re.DOTALL)


def format_think_answer(data_source: str, solution_str: str, ground_truth: Any = None,
                        extra_info: Optional[dict] = None, *, check_answer: bool = False) -> dict[str, float]:
    """Format reward for '<think>...</think> <answer>...</answer>' (the whole response, nothing around it).

    score 1.0 for the format; with check_answer=True the answer must also equal the ground truth (stripped).
    Metrics: format_ok, and acc when check_answer.
    """
    m = _THINK_ANSWER.fullmatch(solution_str.strip())
    ok = 1.0 if m else 0.0
    result = {"score": ok, "format_ok": ok}
    if check_answer:
        acc = 1.0 if m and m.group(1).strip() == str(ground_truth).strip() else 0.0
        result.update(score=acc, acc=acc)
    return result


# ----------------------------------------------------------------------------------------------------------------------
# The synthetic arithmetic task (megarl.data.synthetic)


# the one '#### N' of a response, ending it (see `arithmetic`)
_FINAL_HASH_ANSWER = re.compile(r"####\s*(-?[$\d,.]*\d)$")


def arithmetic(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
               format_score: float = 0.0) -> dict[str, float]:
    """1.0 if the answer equals the ground truth: the response's one '#### N', which must end it (what comes before
    is free: the worked and chain answers restate the sum first), else a response that is only a number.

    Anything else (extra words, no number, a second '####', anything after the answer) scores 0, so RL cannot game
    it by listing numbers. Reading the last '####' and ignoring the rest scored "#### 1 #### 2 #### 1 #### 3" (four
    guesses cut at rollout.response_length, no EOS) and "#### 21 21 21" as right: going on past an answer instead of
    ending it cost nothing and gave another guess, so GRPO on the tiny demo drifted to responses at the length cap,
    EOS lost and entropy rising (HISTORY.md, "Responses that stopped ending"). format_score is given to a well-formed
    but wrong answer. Metrics: acc (1/0) and formatted (1 if an answer could be read).
    """
    text = solution_str.strip()
    found = _FINAL_HASH_ANSWER.search(text) if text.count("####") == 1 else None
    answer = found.group(1) if found else None
    if answer is None and re.fullmatch(r"-?\d+", text):
        answer = text
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "formatted": 0.0}
    correct = normalize_number(answer) == normalize_number(ground_truth)
    return {"score": 1.0 if correct else format_score, "acc": 1.0 if correct else 0.0, "formatted": 1.0}


_EXPRESSION = re.compile(r'"expression"\s*:\s*"\s*(\d+)\s*\*\s*(\d+)\s*"')


def multiply_tool(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
                  format_score: float = 0.0) -> dict[str, float]:
    """The multiplication task with a calculator (megarl.data.synthetic_tool): the arithmetic reward of the final
    answer ('#### N' after the last tool turn), plus the metric correct_call: 1 if the model called the calculator
    with a product of the right value ("expression": "a*b"), whatever it answered."""
    text = solution_str.strip()
    answer = extract_hash_answer(text)
    calls = [int(a) * int(b) for a, b in _EXPRESSION.findall(text)]
    right = normalize_number(str(ground_truth))
    correct_call = float(any(normalize_number(str(c)) == right for c in calls))
    if answer is None:
        return {"score": 0.0, "acc": 0.0, "formatted": 0.0, "correct_call": correct_call}
    correct = normalize_number(answer) == right
    return {"score": 1.0 if correct else format_score, "acc": float(correct), "formatted": 1.0,
            "correct_call": correct_call}


_WALK_STEP = re.compile(r"(\d) (\d) (\d) : (\d)")


def walk(data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None, *,
         modulus: int = 10, stride: int = 3) -> dict[str, float]:
    """The walk task (megarl.data.synthetic_walk), every step checked against the one written before it: score = (right
    steps + a right ending) / (steps + 1), counting the first `steps` steps written. A step "h t o : v" is right when
    its count h t o is one less than the step before's (the first: `steps`) and v = (the value the step before wrote,
    the start for the first, + stride) mod `modulus`; the ending is right when exactly `steps` steps came before it,
    the last counting 1, and its '#### v' repeats the last step's value. extra_info gives start and steps.

    Checked against the written step before, a slip costs that step only: a reward of the final value alone would be
    0 for nearly every sample of a 300-step walk from a model that slips at one wrap in two, and so give GRPO nothing
    to compare. Metrics: acc (1 when every step and the ending are right and the end equals ground_truth),
    steps_right (right steps / steps), wraps_right (right steps among the steps whose value before + stride reaches
    the modulus)."""
    if not extra_info or any(k not in extra_info for k in ("start", "steps")):
        raise ValueError(f"the walk reward needs extra_info with start and steps; got {extra_info!r}")
    start, steps = int(extra_info["start"]), int(extra_info["steps"])
    body, hashes, tail = solution_str.strip().partition("####")
    pieces = [p.strip() for p in body.split(",")] if body.strip() else []
    right = wraps = wraps_right = 0
    count: Optional[int] = steps + 1
    before: Optional[int] = start
    for piece in pieces[:steps]:
        found = _WALK_STEP.fullmatch(piece)
        if found is None:
            count = before = None
            continue
        h, t, o, v = (int(x) for x in found.groups())
        wrap = before is not None and before + stride >= modulus
        ok = count is not None and 100 * h + 10 * t + o == count - 1 and before is not None and \
            v == (before + stride) % modulus
        right += ok
        wraps += wrap
        wraps_right += ok and wrap
        count, before = 100 * h + 10 * t + o, v
    answer = tail.strip()
    ending = bool(hashes and "####" not in tail and len(pieces) == steps and count == 1 and answer.isdigit()
                  and int(answer) == before)
    exact = ending and right == steps and answer == str(ground_truth).strip()
    return {"score": (right + ending) / (steps + 1), "acc": float(exact), "steps_right": right / steps,
            "wraps_right": wraps_right / wraps if wraps else 0.0}
