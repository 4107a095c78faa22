"""A synthetic task whose answer needs a long scratchpad: a walk of 125 to 500 steps around a clock of 20 (the
long-context CPU recipe).

    prompt       [{"role": "user", "content": "Walk from 7 by 5 for 300 steps ?"}]
    response     "300 : 7 + 5 = 12 , 299 : 12 + 5 = 17 , 298 : 17 + 5 = 2 , ... , 1 : 2 + 5 = 7 #### 7"
    ground_truth "7" (the true end), data_source "walk" (scored by megarl.reward's `walk`, every step checked)

Every step is written as its countdown number, the value before, the stride, the value after (mod 20), 8 tokens, so
a walk of n steps is an 8n + 2 token answer: 1,002 tokens at 125 steps, 4,002 at 500. The number of steps is drawn
log-uniformly, so short walks are the most common and a few run to the longest. Each step depends on the one before
(a fixed distance back) and on the stride in the prompt (up to 4,000 tokens back); the countdown tells the model when
to stop. The tokenizer is the arithmetic task's word-level one, with a token per number up to the longest walk.

The demonstrations may slip (slip_share): when a step passes 20, the demonstrator writes one more than the right value
that share of the time, and goes on from what it wrote. With a share above one half, a model that imitates it makes
that slip at every wrap when decoding greedily (a quarter of all steps at the mean stride) and samples it more often
than not, and the reward, which checks every step against the one written before it, has to teach it the wrap.
"""
from __future__ import annotations

import math
import random
from typing import Any, Optional, Sequence

from megarl.data.synthetic import ROLE_TOKENS, SPECIAL_TOKENS, word_level_tokenizer

DATA_SOURCE = "walk"
MODULUS = 20
MIN_STEPS, MAX_STEPS = 125, 500
MAX_STRIDE = 9
TOKENS_PER_STEP = 8  # "300 : 7 + 5 = 12 ," (the last step ends with "#### 7" instead of the comma)
WORDS = ["Walk", "from", "by", "for", "steps", "?", ":", "+", "=", ",", "####"]


def walk_vocab(max_steps: int = MAX_STEPS) -> list[str]:
    """Token strings in id order: specials, role markers, the task's words, the numbers 0 to max(max_steps, 19)."""
    return (list(SPECIAL_TOKENS.values()) + ROLE_TOKENS + WORDS
            + [str(n) for n in range(max(max_steps, MODULUS - 1) + 1)])


def walk_tokenizer(save_dir: str, max_steps: int = MAX_STEPS):
    """Build, save and return the task's word-level tokenizer (with its chat template) in save_dir."""
    return word_level_tokenizer(save_dir, walk_vocab(max_steps))


def format_walk_question(start: int, stride: int, steps: int) -> str:
    """format_walk_question(7, 5, 300) == "Walk from 7 by 5 for 300 steps ?"."""
    return f"Walk from {start} by {stride} for {steps} steps ?"


def walk_values(start: int, stride: int, steps: int, slips: Optional[Sequence[int]] = None) -> list[int]:
    """The values after each step, [v1, ..., vn], v_k = (v_{k-1} + stride + slips[k-1]) mod MODULUS from v0 = start:
    walk_values(17, 5, 2) == [2, 7]; with slips [1, 0]: [3, 8]."""
    slips = list(slips) if slips is not None else [0] * steps
    values, v = [], start
    for slip in slips:
        v = (v + stride + slip) % MODULUS
        values.append(v)
    return values


def format_walk_response(start: int, stride: int, steps: int, slips: Optional[Sequence[int]] = None) -> str:
    """The worked walk: format_walk_response(17, 5, 2) == "2 : 17 + 5 = 2 , 1 : 2 + 5 = 7 #### 7"."""
    values = walk_values(start, stride, steps, slips)
    before = [start] + values[:-1]
    lines = [f"{steps - k} : {b} + {stride} = {v}" for k, (b, v) in enumerate(zip(before, values))]
    return " , ".join(lines) + f" #### {values[-1]}"


def draw_steps(rng: random.Random, min_steps: int = MIN_STEPS, max_steps: int = MAX_STEPS) -> int:
    """A number of steps log-uniform in [min_steps, max_steps] (125-500: median 250, mean 270)."""
    return min(max_steps, int(math.exp(rng.uniform(math.log(min_steps), math.log(max_steps + 1)))))


def make_walk_dataset(n: int, seed: int, split: str = "train", slip_share: float = 0.0, min_steps: int = MIN_STEPS,
                      max_steps: int = MAX_STEPS) -> list[dict[str, Any]]:
    """n rows of "Walk from s by d for k steps ?" (s in [0, 19], d in [1, MAX_STRIDE], k from draw_steps),
    reproducible from seed; `response` the worked walk (format_walk_response), ground_truth the true end, extra_info
    {start, stride, steps} (what the `walk` reward checks every step by) and the demonstration's slip count.

    slip_share: the share of the demonstration's wrapping steps (v + d >= 20) written one too high, the walk going on
    from the written value (sft rows only, as the chain task's slips)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 1 <= min_steps <= max_steps:
        raise ValueError(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
    if not 0 <= slip_share < 1:
        raise ValueError(f"need 0 <= slip_share < 1, got {slip_share}")
    rng = random.Random(f"megarl-walk:{seed}")
    slip_rng = random.Random(f"megarl-walk-slips:{seed}")  # its own stream: the questions stay the same at any share
    rows = []
    for i in range(n):
        start, stride = rng.randrange(MODULUS), rng.randint(1, MAX_STRIDE)
        steps = draw_steps(rng, min_steps, max_steps)
        slips, v = [], start
        for _ in range(steps):
            wraps = v + stride >= MODULUS
            slip = 1 if wraps and slip_share and slip_rng.random() < slip_share else 0
            slips.append(slip)
            v = (v + stride + slip) % MODULUS
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": format_walk_question(start, stride, steps)}],
            "response": format_walk_response(start, stride, steps, slips),
            "ground_truth": str(walk_values(start, stride, steps)[-1]),
            "extra_info": {"index": i, "split": split, "start": start, "stride": stride, "steps": steps,
                           "slips": sum(slips)},
        })
    return rows
