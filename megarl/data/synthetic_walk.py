"""A synthetic task whose answer needs a long scratchpad: a walk of 170 to 666 steps of 3 around a clock of 10, with
a countdown written digit by digit (the long-context CPU recipe).

    prompt       [{"role": "user", "content": "Walk from 7 for 3 4 7 steps ?"}]
    response     "3 4 7 : 0 , 3 4 6 : 3 , 3 4 5 : 6 , ... , 0 0 1 : 8 #### 8"
    ground_truth "8" (the true end), data_source "walk" (scored by megarl.reward's `walk`, every step checked)

Every step is written as its countdown number (three digits: 347 counts down to 001, a borrow across digits every
tenth step) and the value after it, (value before + 3) mod 10: 6 tokens, so a walk of n steps is a 6n + 1 token
answer: 1,021 tokens at 170 steps, 3,997 at 666. The number of steps is drawn log-uniformly, so short walks are the
most common and a few run to the longest. Each step depends on the one before it, a fixed distance back; the countdown
tells the model when to stop. The vocabulary is the digits and a few words.

The demonstrations may slip (slip_share): when a step passes 10 (from 7, 8 or 9), the demonstrator writes one more than
the right value that share of the time, and goes on from what it wrote. With a share above one half, a model that
imitates it makes that slip at every wrap when decoding greedily (three steps in ten) and samples it more often than
not, and the reward, which checks every step against the one written before it, has to teach it the wrap.
"""
from __future__ import annotations

import math
import random
from typing import Any, Optional, Sequence

from megarl.data.synthetic import ROLE_TOKENS, SPECIAL_TOKENS, word_level_tokenizer

DATA_SOURCE = "walk"
MODULUS = 10
STRIDE = 3
MIN_STEPS, MAX_STEPS = 170, 666
# the demonstrations (sft.parquet) start from 10 steps: a walk's first step copies the count from the prompt, once a
# walk, and short walks teach it at a fraction of the tokens (from 170 steps, 300 SFT steps of 4 walks left greedy
# decoding miscopying it and everything after off course); a third of them still reach 170 to 666 steps
SFT_MIN_STEPS = 10
COUNT_DIGITS = 3
WORDS = ["Walk", "from", "for", "steps", "?", ":", ",", "####"]


def walk_vocab() -> list[str]:
    """Token strings in id order: specials, role markers, the task's words, the digits 0 to 9."""
    return list(SPECIAL_TOKENS.values()) + ROLE_TOKENS + WORDS + [str(d) for d in range(10)]


def walk_tokenizer(save_dir: str):
    """Build, save and return the task's word-level tokenizer (with its chat template) in save_dir."""
    return word_level_tokenizer(save_dir, walk_vocab())


def spell(count: int) -> str:
    """A count in COUNT_DIGITS digits, one token each: spell(47) == "0 4 7"."""
    if not 0 <= count < 10 ** COUNT_DIGITS:
        raise ValueError(f"a count is written in {COUNT_DIGITS} digits; got {count}")
    return " ".join(str(count).zfill(COUNT_DIGITS))


def format_walk_question(start: int, steps: int) -> str:
    """format_walk_question(7, 347) == "Walk from 7 for 3 4 7 steps ?"."""
    return f"Walk from {start} for {spell(steps)} steps ?"


def walk_values(start: int, steps: int, slips: Optional[Sequence[int]] = None) -> list[int]:
    """The values after each step, [v1, ..., vn], v_k = (v_{k-1} + STRIDE + slips[k-1]) mod MODULUS from v0 = start:
    walk_values(8, 2) == [1, 4]; with slips [1, 0]: [2, 5]."""
    slips = list(slips) if slips is not None else [0] * steps
    values, v = [], start
    for slip in slips:
        v = (v + STRIDE + slip) % MODULUS
        values.append(v)
    return values


def format_walk_response(start: int, steps: int, slips: Optional[Sequence[int]] = None) -> str:
    """The worked walk: format_walk_response(8, 2) == "0 0 2 : 1 , 0 0 1 : 4 #### 4"."""
    values = walk_values(start, steps, slips)
    return " , ".join(f"{spell(steps - k)} : {v}" for k, v in enumerate(values)) + f" #### {values[-1]}"


def draw_steps(rng: random.Random, min_steps: int = MIN_STEPS, max_steps: int = MAX_STEPS) -> int:
    """A number of steps log-uniform in [min_steps, max_steps] (170-666: median 337, mean 364)."""
    return min(max_steps, int(math.exp(rng.uniform(math.log(min_steps), math.log(max_steps + 1)))))


def make_walk_dataset(n: int, seed: int, split: str = "train", slip_share: float = 0.0, min_steps: int = MIN_STEPS,
                      max_steps: int = MAX_STEPS) -> list[dict[str, Any]]:
    """n rows of "Walk from s for k steps ?" (s in [0, 9], k from draw_steps), reproducible from seed; `response`
    the worked walk (format_walk_response), ground_truth the true end, extra_info {start, steps} (what the `walk`
    reward checks every step by) and the demonstration's slip count.

    slip_share: the share of the demonstration's wrapping steps (v + 3 >= 10) written one too high, the walk going on
    from the written value (sft rows only, as the chain task's slips)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= min_steps <= max_steps < 10 ** COUNT_DIGITS:
        raise ValueError(f"need 1 <= min_steps <= max_steps < {10 ** COUNT_DIGITS}, got {min_steps}, {max_steps}")
    if not 0 <= slip_share < 1:
        raise ValueError(f"need 0 <= slip_share < 1, got {slip_share}")
    rng = random.Random(f"megarl-walk:{seed}")
    slip_rng = random.Random(f"megarl-walk-slips:{seed}")  # its own stream: the questions stay the same at any share
    rows = []
    for i in range(n):
        start, steps = rng.randrange(MODULUS), draw_steps(rng, min_steps, max_steps)
        slips, v = [], start
        for _ in range(steps):
            wraps = v + STRIDE >= MODULUS
            slip = 1 if wraps and slip_share and slip_rng.random() < slip_share else 0
            slips.append(slip)
            v = (v + STRIDE + slip) % MODULUS
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": format_walk_question(start, steps)}],
            "response": format_walk_response(start, steps, slips),
            "ground_truth": str(walk_values(start, steps)[-1]),
            "extra_info": {"index": i, "split": split, "start": start, "steps": steps, "slips": sum(slips)},
        })
    return rows
