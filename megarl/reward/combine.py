"""The step's reward from named components: rule functions, the reward model (and what else reward.components lists).

    reward:
      reward_fn: arithmetic                       # validation, and rule components without their own fn
      reward_model: {enable: true, path: runs/rm_tiny_cpu/rm_model}
      components:
        correct: {fn: arithmetic}                 # type rule (default)
        formatted: {fn: format_regex, kwargs: {pattern: "^#### "}, weight: 0.2}
        rm: {type: reward_model, weight: 0.5, normalize: true, clip: [-3, 3]}
      combine_fn: null                            # or 'path/to/file.py:function'

Each component is scored on every sample; normalize (over the step's samples) and clip apply in that order; the total
is sum(weight * value), or combine_fn({name: [N] tensor}) -> [N] when given. Logged per step: reward/<name>_mean (the
component's raw score), reward/total_mean (the total), and logging.save_rollouts records each sample's components.

Without components: the reward model's score when reward.reward_model.enable (verl's behaviour), else
reward.reward_fn. Validation is always scored by reward.reward_fn (or the data_source routing): the measure a learned
reward is meant to serve, which the policy cannot game.
"""
from __future__ import annotations

from typing import Callable, Mapping, Optional

import torch


def transform(x: torch.Tensor, normalize: bool, clip: Optional[tuple]) -> torch.Tensor:
    """x [N] standardised over the batch ((x - mean) / (std + 1e-6), population std) when normalize, then clipped."""
    x = x.float()
    if normalize:
        x = (x - x.mean()) / (x.std(unbiased=False) + 1e-6)
    if clip is not None:
        x = x.clamp(clip[0], clip[1])
    return x


def combine(raw: Mapping[str, torch.Tensor], settings: Mapping, combine_fn: Optional[Callable] = None) -> torch.Tensor:
    """The total [N] from raw component scores {name: [N]} and their settings (weight, normalize, clip)."""
    used = {name: transform(raw[name], s.normalize, s.clip) for name, s in settings.items()}
    if combine_fn is not None:
        total = torch.as_tensor(combine_fn(used), dtype=torch.float32)
        n = next(iter(used.values())).shape
        if total.shape != n or not torch.isfinite(total).all():
            raise ValueError(f"reward.combine_fn returned {tuple(total.shape)} values (finite: "
                             f"{bool(torch.isfinite(total).all())}); it must return {tuple(n)} finite scores")
        return total
    return sum(s.weight * used[name] for name, s in settings.items())


class StepReward:
    """What scores a step's samples: the rule function (reward.reward_fn or routing), the reward model, the judge
    (its engine on global rank 0), named components.

    Passed to megarl.steps.score in place of a bare reward function; `rule` scores validation."""

    def __init__(self, cfg, policy_tokenizer, rule_fn, is_rank0: bool = True):
        from megarl.reward.registry import get_reward_fn, load_reward_fn

        r = cfg.reward
        self.rule = rule_fn
        self.components = dict(r.components)
        if not self.components:  # the defaults: the reward model's score, else the judge's, else the rule
            from megarl.config.schema import RewardComponentConfig

            kind = "reward_model" if r.reward_model.enable else "judge" if r.judge.enable else "rule"
            self.components = {kind: RewardComponentConfig(type=kind)}
        self.rule_fns = {name: get_reward_fn(c.fn) if c.fn else rule_fn
                         for name, c in self.components.items() if c.type == "rule"}
        self.combine_fn = load_reward_fn(r.combine_fn) if r.combine_fn else None
        self.reward_model = self.judge = None
        if r.reward_model.enable:
            from megarl.reward.model import RewardModelScorer

            self.reward_model = RewardModelScorer(cfg, policy_tokenizer)
        if r.judge.enable and is_rank0:
            from megarl.reward.judge import Judge

            self.judge = Judge(cfg, seed=cfg.trainer.seed)

    def learned_scores(self, rollout, records, rt) -> tuple[dict[str, torch.Tensor], dict]:
        """Collective (every rank): {"reward_model": [N]} and metrics."""
        if self.reward_model is None:
            return {}, {}
        scores, metrics = self.reward_model.score(rollout, records, rt)
        return {"reward_model": scores}, metrics

    def total(self, samples, questions, learned: dict, cfg) -> tuple[torch.Tensor, dict, dict, dict]:
        """On rank 0: (total [N], rule extras {name: [N] values}, report (with the judge's metrics), {component: raw
        [N]}). questions: each sample's prompt as the judge sees it (megarl.reward.judge.question_text)."""
        from megarl.reward.compute import compute_rewards

        r = cfg.reward
        raw: dict[str, torch.Tensor] = {}
        extras: dict = {}
        report = {"num_timed_out": 0, "seconds": 0.0, "metrics": {}}
        for name, c in self.components.items():
            if c.type == "rule":
                kwargs = c.kwargs if c.fn else {**r.reward_kwargs, **c.kwargs}
                values, extra, rep = compute_rewards(self.rule_fns[name], samples, r.timeout_s, r.num_workers, kwargs)
                raw[name] = torch.tensor(values, dtype=torch.float32)
                extras.update(extra)
                report["num_timed_out"] += rep["num_timed_out"]
                report["seconds"] += rep["seconds"]
            elif c.type == "judge":
                values, metrics, _ = self.judge.grade(questions, samples)
                raw[name] = torch.tensor(values, dtype=torch.float32)
                report["metrics"].update(metrics)
            else:
                raw[name] = learned[c.type]
        return combine(raw, self.components, self.combine_fn), extras, report, raw

    def close(self) -> None:
        if self.judge is not None:
            self.judge.close()
