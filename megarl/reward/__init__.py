"""Rewards: rule-based functions, custom functions from files, per-row routing, batched scoring.

The reward function contract (the same as verl's `compute_score`, so existing functions work unchanged)
-------------------------------------------------------------------------------------------------------
    def fn(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
           **reward_kwargs) -> float | dict

- solution_str is the decoded response only (no prompt, special tokens skipped).
- Return a finite number, or a dict with a finite "score" and any other keys, which are logged as per-sample
  metrics (e.g. {"score": 1.0, "acc": 1.0}). bool counts as a number.
- reward.reward_kwargs are passed as keyword arguments to every call; keys the function does not accept are
  reported before the first call.
- Raising, or returning NaN/inf/None/a non-number/a dict without "score", stops the step with a RewardError that
  names the sample (index, uid, data_source, first 200 characters of the response) and the last traceback frames.

Choosing the function (reward.reward_fn)
----------------------------------------
- a registered name:  gsm8k | math | math_dapo | exact_match | format_regex | format_think_answer | arithmetic |
                      multiply_tool | walk
- a file:             reward.reward_fn=path/to/my_reward.py:my_fn   (path/to/my_reward.py alone: compute_score)
- null (default):     per row by its data_source column. Known data_sources are the registered names plus the aliases
                      openai/gsm8k -> gsm8k; lighteval/MATH, DigitalLearningGmbH/MATH-lighteval, HuggingFaceH4/MATH-500,
                      hendrycks_math -> math; megarl/arithmetic -> arithmetic.
                      Add more with register_reward(name, fn, aliases).

Registered rules (megarl.reward.rules)
--------------------------------------
- gsm8k(strict=False, format_score=0.0): number after the last '####' (else the last number unless strict), compared
  numerically ('1,000' == '1000', '72.0' == '72'); a found-but-wrong answer gets format_score.
- math(format_score=0.0): last \\boxed{...} (nested braces balanced), normalised (spaces, $, \\left/\\right, \\dfrac,
  \\frac{a}{b} -> a/b, trailing '.0'); equal as strings or as numbers (1/2 == 0.5).
- exact_match(case_sensitive=True): stripped string equality.
- format_regex(pattern, fullmatch=False, dotall=True): 1.0 if the regex matches.
- format_think_answer(check_answer=False): '<think>..</think> <answer>..</answer>' format (and the answer with
  check_answer); returns score and format_ok (and acc).
- arithmetic(format_score=0.0): the synthetic task of megarl.data.synthetic ('#### 21' or just '21'); metrics acc,
  formatted.

Batched scoring
---------------
    fn = reward_fn_from_config(cfg.reward)                     # a function, or a RewardRouter when reward_fn is null
    scores, metrics, report = compute_rewards(fn, [RewardInput(ds, text, gt, extra, uid), ...],
                                              timeout_s=cfg.reward.timeout_s, num_workers=cfg.reward.num_workers,
                                              reward_kwargs=cfg.reward.reward_kwargs)
A sample running longer than timeout_s scores 0.0 (metrics None) and is counted in report["num_timed_out"];
its worker process is killed (see megarl.reward.compute).
"""
from megarl.reward import rules
from megarl.reward.compute import RewardInput, check_reward_kwargs, compute_rewards, to_score
from megarl.reward.registry import (ALIASES, REGISTRY, RewardError, RewardRouter, get_reward_fn, load_reward_fn,
                                    register_reward, reward_fn_from_config)

__all__ = [
    "rules", "RewardInput", "check_reward_kwargs", "compute_rewards", "to_score",
    "ALIASES", "REGISTRY", "RewardError", "RewardRouter", "get_reward_fn", "load_reward_fn", "register_reward",
    "reward_fn_from_config",
]
