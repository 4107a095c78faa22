"""The named stages of one RL step, called in order by megarl.trainer. Each documents where it runs."""
from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from statistics import fmean
from typing import Callable, Optional, Sequence

import torch

from megarl import algo
from megarl.agent.loop import COUNT_KEYS as TOOL_COUNT_KEYS, tool_rates
from megarl.batching import route_coverage, sequence_lengths
from megarl.config import MegarlConfig
from megarl.rollout.protocol import Deferred
from megarl.data import PromptRecord, val_batches
from megarl.metrics import combine_round_metrics
from megarl.report import pick_samples
from megarl.reward import rules
from megarl.reward.compute import RewardInput, compute_rewards
from megarl.reward.registry import RewardError, RewardRouter
from megarl.rollout.replicas import broadcast_rollout, combine
from megarl.distributed import all_gather_objects, broadcast_object, compute_device
from megarl.runtime import Runtime
from megarl.types import RolloutBatch

log = logging.getLogger("megarl")


class Timer:
    """Accumulates wall time per phase: `with timer("rollout"): ...`; read as timing/<phase>_s metrics."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict:
        return {f"timing/{k}_s": v for k, v in self.seconds.items()}


def generate(engine, records: Sequence[PromptRecord], rt: Runtime, validate: bool = False,
             seed: Optional[int] = None, greedy: bool = False, multi_turn: bool = False) -> RolloutBatch:
    """Sample responses on the engine replicas (each its contiguous share of the prompts); every rank returns the
    whole RolloutBatch, moved as tensors. Sampling seeds follow the global prompt index (replica-independent).
    greedy: one greedy response per prompt (ReMax baselines). multi_turn: each replica runs the agent loop
    (rollout.multi_turn, megarl.agent) for its prompts. `engine` may be the run's EngineGeneration: a lost engine
    replica is then restarted and its share generated again."""
    if isinstance(engine, EngineGeneration):
        return engine.generate(records, validate=validate, seed=seed, greedy=greedy, multi_turn=multi_turn)
    return finish_generate(start_generate(engine, records, rt, validate, seed, greedy, multi_turn), rt)


def start_generate(engine, records: Sequence[PromptRecord], rt: Runtime, validate: bool = False,
                   seed: Optional[int] = None, greedy: bool = False, multi_turn: bool = False,
                   replicas: Optional[set] = None) -> list:
    """The first half of `generate`, not collective: this rank's engine (if it owns one) starts on its replica's
    share and generates while the caller goes on (multi-turn rollouts run to their end first). Returns one entry per
    replica: this rank's handle, None elsewhere. `replicas`: only these replicas start (a lost one's share again)."""
    topo = rt.engines
    shares = []
    for replica in range(topo.replicas):
        part = topo.prompt_slice(replica, len(records))
        handle = None
        if engine is not None and topo.replica_of(rt.rank) == replica and (replicas is None or replica in replicas):
            prompts, index = [r.prompt_ids for r in records[part]], list(range(part.start, part.stop))
            # image prompts: each prompt's images (encoded bytes or paths) travel to the engine, which makes the
            # patches itself; text-only batches send nothing more
            images = {"images": [r.images for r in records[part]]} if any(r.images for r in records[part]) else {}
            if multi_turn:
                handle = Deferred.ready(engine.rollout_agents(prompts, validate=validate, prompt_index=index, seed=seed,
                                                        extra_infos=[r.extra_info for r in records[part]]))
            else:
                handle = engine.start_generate(prompts, validate=validate, prompt_index=index, seed=seed,
                                               greedy=greedy, **images)
        shares.append(handle)
    return shares


def finish_generate(handles: list, rt: Runtime) -> RolloutBatch:
    """The second half of `generate`, collective: wait for the replicas' shares; every rank gets the whole batch."""
    topo = rt.engines
    # every owner generates before anyone waits on a broadcast, so the replicas run at the same time
    return combine([broadcast_rollout(None if h is None else h.result(), topo.owner(r), device=compute_device())
                    for r, h in enumerate(handles)])


def engine_sleep(engine) -> None:
    """After the step's rollouts: the engine frees its memory for training (rollout.enable_sleep_mode)."""
    if engine is not None and getattr(engine, "sleeps", False):
        engine.sleep()


def score(reward_fn, rollout: RolloutBatch, records: Sequence[PromptRecord], tokenizer, cfg: MegarlConfig,
          rt: Runtime, per_sample: Optional[dict] = None) -> tuple[torch.Tensor, dict]:
    """One reward per sample (rank 0 scores, everyone receives): rule/custom rewards plus DAPO overlong shaping.

    per_sample, if given, receives the reward functions' extra per-sample values (e.g. "acc") as [N] tensors.
    reward_fn may be a megarl.reward.combine.StepReward (reward model, components): its learned scores are computed
    first, on every rank; the components' raw scores are set on rollout.reward_components."""
    from megarl.reward.combine import StepReward
    from megarl.reward.judge import question_text

    result, learned, learned_metrics, raw = None, {}, {}, None
    if isinstance(reward_fn, StepReward):
        learned, learned_metrics = reward_fn.learned_scores(rollout, records, rt)
    if rt.is_rank0:
        samples = []
        for i in range(len(rollout)):
            rec = records[int(rollout.prompt_index[i])]
            text = tokenizer.decode(list(rollout.response(i)), skip_special_tokens=True)
            samples.append(RewardInput(rec.data_source, text, rec.ground_truth, rec.extra_info, rec.uid))
        if isinstance(reward_fn, StepReward):
            questions = [question_text(records[int(k)].prompt) for k in rollout.prompt_index]
            scores, extra, report, raw = reward_fn.total(samples, questions, learned, cfg)
        else:
            scores, extra, report = compute_rewards(reward_fn, samples, cfg.reward.timeout_s, cfg.reward.num_workers,
                                                    cfg.reward.reward_kwargs)
        scores = torch.as_tensor(scores, dtype=torch.float32)
        metrics = {"reward/timed_out": float(report["num_timed_out"]), "timing/reward_compute_s": report["seconds"],
                   **learned_metrics, **report.get("metrics", {})}
        if raw is not None:
            metrics.update({f"reward/{name}_mean": float(v.mean()) for name, v in raw.items()})
            metrics["reward/total_mean"] = float(scores.mean())
        if rollout.tool_rewards is not None:  # what the sample's tool calls contributed (multi-turn)
            scores = scores + rollout.tool_rewards
            metrics["reward/tool_reward_mean"] = float(rollout.tool_rewards.mean())
        for name, values in extra.items():
            present = [float(v) for v in values if isinstance(v, (int, float))]
            if present:
                metrics[f"reward/{name}_mean"] = fmean(present)
        ob = cfg.reward.overlong_buffer
        if ob.enable:
            # the model's own tokens: tool responses in a multi-turn response are not the model's verbosity
            penalty, m = algo.overlong_reward_penalty(rollout.model_token_counts(), cfg.rollout.response_length, ob.len,
                                                      ob.penalty_factor)
            scores = scores + penalty
            metrics.update({f"reward/{k}": float(v) for k, v in m.items()})
        extras = {k: torch.tensor([float(v) if isinstance(v, (int, float)) else float("nan") for v in values])
                  for k, values in extra.items()}
        result = (scores, metrics, extras, raw)
    scores, metrics, extras, raw = broadcast_object(result)
    if per_sample is not None:
        per_sample.update(extras)
    if raw is not None:
        rollout.reward_components = raw
    return scores, metrics


def old_log_probs_from_update(cfg: MegarlConfig, actor_updates: bool) -> bool:
    """True when the separate old-logprob pass can be skipped: the actor updates this step and the batch gets exactly
    one optimizer step (ppo_epochs 1, one mini-batch), so the policy trained is still the one that sampled, and nothing
    reads the old logprobs before the update (no KL penalty in the reward, no rollout correction, no
    optimal_token_baseline, no distillation). The update then
    takes them from its own forward, detached (PPO ratio exactly 1, as verl and TRL do)."""
    a, rc = cfg.actor, cfg.algorithm.rollout_correction
    one_step = a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.data.train_batch_size
    read_before = (cfg.kl_in_reward_active or rc.is_level is not None or rc.rejection_level is not None
                   or rc.use_rollout_log_probs or cfg.algorithm.adv_estimator == "optimal_token_baseline"
                   or cfg.distillation.enable)
    # R2 records the routing in the old-logprob pass, which the reference and update forwards replay
    recorded = cfg.actor.router_replay.mode == "R2"
    return actor_updates and one_step and not read_before and not recorded


# estimators that compare the samples of one prompt (they read the batch's prompt_index)
GROUP_ESTIMATORS = ("grpo", "drgrpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "grpo_passk", "gdpo",
                    "optimal_token_baseline")


def reward_components(cfg: MegarlConfig, per_sample: dict, num_samples: int) -> Optional[torch.Tensor]:
    """gdpo's reward dimensions [N, K]: the reward functions' extra values named by algorithm.gdpo_reward_keys (None
    when no keys are set: gdpo then normalises the reward alone)."""
    keys = cfg.algorithm.gdpo_reward_keys
    if cfg.algorithm.adv_estimator != "gdpo" or not keys:
        return None
    missing = [k for k in keys if k not in per_sample]
    if missing:
        raise ValueError(f"algorithm.gdpo_reward_keys names {missing}, but the reward function returned no such "
                         f"values (it returned {sorted(per_sample)}): return a dict with a value per key")
    components = torch.stack([per_sample[k].to(torch.float32) for k in keys], dim=1)
    if components.shape[0] != num_samples or bool(components.isnan().any()):
        raise ValueError(f"algorithm.gdpo_reward_keys {keys}: every sample needs a numeric value for every key")
    return components


def compute_advantages(cfg: MegarlConfig, batch: dict, kl_ctrl=None) -> dict:
    """token_level_rewards, advantages and returns ([N, T]) on every rank (pure, identical everywhere)."""
    a = cfg.algorithm
    metrics = {}
    rewards = batch["token_level_scores"]
    if cfg.kl_in_reward_active:
        rewards, m = algo.apply_kl_penalty(rewards, batch["old_log_probs"], batch["ref_log_probs"],
                                           batch["response_mask"], kl_ctrl.value, a.kl_penalty)
        kl_ctrl.update(float(m["kl"]), n_steps=cfg.data.train_batch_size)
        metrics.update({"actor/reward_kl": float(m["kl"]), "actor/kl_coef": float(m["kl_coef"])})
    batch["token_level_rewards"] = rewards
    kwargs = dict(token_level_rewards=rewards, response_mask=batch["response_mask"])
    if a.adv_estimator == "gae":
        kwargs.update(values=batch["values"], gamma=a.gamma, lam=a.lam)
    elif a.adv_estimator in GROUP_ESTIMATORS:
        kwargs.update(index=batch["prompt_index"])
        if a.adv_estimator in ("grpo", "grpo_passk", "gdpo"):
            kwargs.update(norm_adv_by_std=a.norm_adv_by_std_in_grpo)
        if a.adv_estimator == "gdpo":
            # popped: [N, K] has no token axis, and nothing after the advantages reads it
            kwargs.update(reward_components=batch.pop("reward_components", None), reward_weights=a.gdpo_reward_weights)
        if a.adv_estimator == "optimal_token_baseline":
            kwargs.update(old_log_probs=batch["old_log_probs"], sum_pi_squared=batch["sum_pi_squared"],
                          rollout_is_weights=batch.get("rollout_is_weights"))
    elif a.adv_estimator == "reinforce_plus_plus":
        kwargs.update(gamma=a.gamma)
    elif a.adv_estimator == "remax":
        kwargs.update(reward_baselines=batch["reward_baselines"])
    batch["advantages"], batch["returns"] = algo.ADV_ESTIMATORS[a.adv_estimator](**kwargs)
    return metrics


def add_distillation_advantage(cfg: MegarlConfig, batch: dict) -> dict:
    """distillation.enable: the teacher's per-token reverse-KL signal added to the task advantages (in place)."""
    adv, m = algo.reverse_kl_advantage(batch["old_log_probs"], batch["teacher_log_probs"], batch["response_mask"],
                                       cfg.distillation.kl_coef)
    batch["advantages"] = batch["advantages"] + adv.to(batch["advantages"].dtype)
    return {f"distill/{k}": float(v) for k, v in m.items()}


def remax_baselines(engine, reward_fn, records: Sequence[PromptRecord], rollout: RolloutBatch, tokenizer,
                    cfg: MegarlConfig, rt: Runtime) -> tuple[torch.Tensor, dict]:
    """ReMax's baseline [N]: for each sample, the reward of the greedy response to its prompt (one greedy rollout per
    prompt, scored like the samples). Returns (baselines, metrics)."""
    greedy = generate(engine, records, rt, greedy=True)
    greedy_scores, _ = score(reward_fn, greedy, records, tokenizer, cfg, rt)
    per_prompt = torch.zeros(len(records), dtype=torch.float32)
    per_prompt[greedy.prompt_index] = greedy_scores
    return per_prompt[rollout.prompt_index], {"remax/baseline_reward_mean": greedy_scores.mean().item()}


def weight_sync(actor, engine, cfg: MegarlConfig, rt: Runtime, factory=None):
    """The live weight sync, planned (a collective) by the transport the recipe picks (megarl.sync.factory); pass the
    factory of an earlier plan to plan again over the same mapping and holdings (after an engine restart)."""
    from megarl.sync.factory import SyncFactory

    factory = factory or SyncFactory(actor.chunks, actor.spec)
    return factory.for_recipe(cfg, engine, rt.engines)


def sync_weights(actor, engine, sync, cfg: MegarlConfig, rt: Runtime, verify: bool = False,
                 before_kv_cache=None, replicas: Optional[set] = None) -> dict:
    """Deliver the actor's weights to every engine worker (every rank takes part). With sleep mode the engine wakes
    its weights only, receives them, then wakes its KV cache. `before_kv_cache()` runs after the delivery, before the
    KV cache wakes (the trainer offloads its states there). `replicas`: only these engine replicas need the weights
    (restarted ones; the others keep theirs): the colocated transport delivers to them alone."""
    if replicas is not None and not getattr(sync, "partial", False):
        replicas = None  # a transport that delivers to every engine (remote: survivors take a delta of nothing)
    if replicas is not None and rt.engines.replica_of(rt.rank) not in replicas:
        engine = None  # this rank's replica keeps its weights: it only sends pieces to the others
    sleeping = engine is not None and getattr(engine, "sleeps", False)
    if sleeping:
        engine.wake_up(["weights"])
    metrics = sync.run(engine, verify=verify) if replicas is None else sync.run(engine, verify=verify,
                                                                                  replicas=replicas)
    if before_kv_cache is not None:
        before_kv_cache()
    if sleeping:
        engine.wake_up(["kv_cache"])
    return metrics if rt.is_rank0 else {}


def batch_metrics(batch: dict, rollout: RolloutBatch, scores: torch.Tensor) -> dict:
    mask = batch["response_mask"]
    lengths = rollout.response_lengths.float()
    metrics = {
        "train/reward_mean": scores.mean().item(), "train/reward_max": scores.max().item(),
        "train/reward_min": scores.min().item(), "train/response_length_mean": lengths.mean().item(),
        "train/response_length_max": lengths.max().item(), "train/truncated_frac": rollout.truncated.float().mean().item(),
        "train/advantage_mean": algo.masked_mean(batch["advantages"], mask).item(),
    }
    if "routed_experts" in batch:  # rollout.return_routed_experts: how much of the batch the engine's routes cover
        metrics["rollout/routed_experts_coverage"] = route_coverage(batch["routed_experts"],
                                                                    sequence_lengths(batch).cpu())
    if rollout.rollout_logprobs is None:  # rollout.calculate_log_probs=false: no engine logprobs to compare with
        return metrics
    diff = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs()
    metrics.update({"rollout/logprob_abs_diff_mean": algo.masked_mean(diff, mask).item(),
                    "rollout/logprob_abs_diff_max": diff[mask].max().item() if mask.any() else 0.0})
    mismatch = {k: float(v) for k, v in algo.rollout_mismatch_metrics(
        batch["old_log_probs"], batch["rollout_log_probs"], mask).items()}
    metrics.update(mismatch)
    # verl's names for the same values (rollout_corr/kl, rollout_corr/log_ppl_abs_diff, rollout_corr/chi2_token, ...)
    metrics.update({f"rollout_corr/{algo.VERL_MISMATCH_NAMES[k]}": v for k, v in mismatch.items()})
    return metrics


def actor_summary(metrics: dict) -> dict:
    """The headline actor metrics under their stable names (actor/kl is the approximate KL to the old policy)."""
    aliases = {"actor/clip_frac": "actor/pg_clipfrac", "actor/kl": "actor/ppo_kl"}
    return {k: metrics[v] for k, v in aliases.items() if v in metrics}


def sample_rows(records: Sequence[PromptRecord], rollout: RolloutBatch, scores: torch.Tensor, tokenizer,
                picks: Sequence[tuple[int, str]], per_sample: Optional[dict] = None) -> list[dict]:
    """The samples `picks` ((row, label) pairs) of a scored batch as plain dicts for the run's sample files: label,
    prompt and response text, score, ground truth, data_source, response length in tokens, whether it hit the length
    cap, and the reward functions' extra per-sample values (per_sample: name -> [N] tensor, e.g. acc) where known.
    scores: [N]."""
    rows = []
    for i, label in picks:
        rec = records[int(rollout.prompt_index[i])]
        row = {"label": label, "prompt": tokenizer.decode(list(rollout.prompt_ids[i]), skip_special_tokens=True),
               "response": tokenizer.decode(list(rollout.response(i)), skip_special_tokens=True),
               "score": float(scores[i]), "ground_truth": rec.ground_truth, "data_source": rec.data_source,
               "response_length": int(rollout.response_lengths[i]), "truncated": bool(rollout.truncated[i])}
        for name, values in (per_sample or {}).items():
            value = float(values[i])
            if not math.isnan(value):
                row[name] = value
        rows.append(row)
    return rows


def train_samples(records: Sequence[PromptRecord], rollout: RolloutBatch, scores: torch.Tensor, tokenizer,
                  per_sample: Optional[dict] = None) -> list[dict]:
    """A step's samples for `megarl report`: one correct and one wrong where the reward tells (an "acc" value per
    sample), else the highest and the lowest scored (megarl.report.pick_samples). Rank 0 (it decodes)."""
    acc = per_sample.get("acc") if per_sample else None
    picks = pick_samples(scores.tolist(), None if acc is None else acc.tolist())
    return sample_rows(records, rollout, scores, tokenizer, picks, per_sample)


def _rule_of(reward_fn, data_source: str):
    """The reward function a row's data_source is scored by (a RewardRouter routes by it); None where unknown."""
    if isinstance(reward_fn, RewardRouter):
        try:
            return reward_fn.resolve(data_source)
        except RewardError:
            return None
    return reward_fn


def answer_checks(reward_fn, samples: Sequence[RewardInput], reward_kwargs: dict) -> dict[str, list[float]]:
    """Accuracy apart from format for the rows the gsm8k rule scores (reward.reward_fn=gsm8k, or data_source routed
    to it: megarl.reward.registry.ALIASES), whose reward mixes the two (a wrong answer may earn format_score, and
    without strict any last number counts): "acc" 1.0 when the final answer (as the rule reads it, with the recipe's
    strict) is correct, "format" 1.0 when a '####' answer is present. Other rows: NaN. Returns name -> [N] values."""
    strict = bool(reward_kwargs.get("strict", False))
    acc, fmt = [], []
    for s in samples:
        if _rule_of(reward_fn, s.data_source) is not rules.gsm8k:
            acc.append(float("nan"))
            fmt.append(float("nan"))
            continue
        # score 1, format_score 0: the rule's own answer reading, without the recipe's reward shaping
        acc.append(float(rules.gsm8k(s.data_source, s.solution_str, s.ground_truth, s.extra_info, strict=strict)))
        fmt.append(float(rules.extract_hash_answer(s.solution_str) is not None))
    return {"acc": acc, "format": fmt}


def _fill_missing(extras: dict, checks: Optional[dict[str, torch.Tensor]]) -> None:
    """Add the answer checks to the reward functions' per-sample extras: where a function gave no value (NaN, or no
    such name) the check's value is used; a value the function gave wins."""
    for name, values in (checks or {}).items():
        if bool(values.isnan().all()):
            continue
        if name in extras:
            extras[name] = torch.where(extras[name].isnan(), values, extras[name])
        else:
            extras[name] = values


def val_file_of(record: PromptRecord) -> str:
    """The stem of the file a record came from ('val_unseen' for uid 'val_unseen.parquet#12')."""
    name = record.uid.rsplit("#", 1)[0]
    return name.rsplit(".", 1)[0] if "." in name else name


def validate(engine, reward_fn, records: Sequence[PromptRecord], tokenizer, cfg: MegarlConfig, rt: Runtime,
             generations: Optional[list] = None) -> dict:
    """Greedy (val_kwargs) rollouts on the validation set, data.val_batch_size prompts at a time (None: all at once);
    val/reward_mean, per data_source means, the reward functions' extra values (val/<name>_mean, e.g. acc) and, for
    multi-turn rollouts, the tool rates (val/tool/use_rate, ...); with several val files, val/<file stem>/reward_mean
    and its extra values per file. For rows the gsm8k rule scores also val/acc_mean
    (correct final answer) and val/format_mean (a '####' answer present) apart (`answer_checks`).

    generations, if given, receives on rank 0 the first trainer.log_val_generations prompts of the set, one response
    each (the first of val_kwargs.n), as `sample_rows` dicts."""
    if not records:
        return {}
    reward_fn = getattr(reward_fn, "rule", reward_fn)  # a learned reward trains; the rule measures (combine.py)
    parts, sources, files, extras, tool_counts, start = [], [], [], {}, {}, 0
    shown = cfg.trainer.log_val_generations if generations is not None and rt.is_rank0 else 0
    for chunk in val_batches(records, cfg.data.val_batch_size):
        # prompt i of the whole set keeps the seeds it would have in one batch (seed + i * n + j)
        rollout = generate(engine, chunk, rt, validate=True, seed=cfg.trainer.seed + start * cfg.rollout.val_kwargs.n,
                           multi_turn=cfg.rollout.multi_turn.enable)
        per_sample: dict = {}
        scores = score(reward_fn, rollout, chunk, tokenizer, cfg, rt, per_sample=per_sample)[0]
        parts.append(scores)
        checks = None
        # rank 0 decodes (only where a row is the gsm8k rule's); every rank gets the values, as it gets the scores
        if rt.is_rank0 and any(_rule_of(reward_fn, r.data_source) is rules.gsm8k for r in chunk):
            samples = [RewardInput(chunk[int(k)].data_source,
                                   tokenizer.decode(list(rollout.response(i)), skip_special_tokens=True),
                                   chunk[int(k)].ground_truth, chunk[int(k)].extra_info)
                       for i, k in enumerate(rollout.prompt_index)]
            checks = {k: torch.tensor(v, dtype=torch.float32)
                      for k, v in answer_checks(reward_fn, samples, cfg.reward.reward_kwargs).items()}
        _fill_missing(per_sample, broadcast_object(checks))
        if start < shown:  # the first row of each prompt of the set's first `shown`
            first = {}
            for i, k in enumerate(rollout.prompt_index.tolist()):
                if start + k < shown:
                    first.setdefault(k, i)
            generations += sample_rows(chunk, rollout, scores, tokenizer,
                                       [(first[k], f"prompt {start + k}") for k in sorted(first)], per_sample)
        for name, values in per_sample.items():
            extras.setdefault(name, []).append(values)
        for key in TOOL_COUNT_KEYS:
            if key in rollout.metrics:
                tool_counts[key] = tool_counts.get(key, 0.0) + rollout.metrics[key]
        sources += [chunk[int(i)].data_source for i in rollout.prompt_index]
        files += [val_file_of(chunk[int(i)]) for i in rollout.prompt_index]
        start += len(chunk)
    scores = torch.cat(parts)
    metrics = {"val/reward_mean": scores.mean().item()}
    for source in sorted(set(sources)):
        picked = torch.tensor([s == source for s in sources])
        metrics[f"val/{source}/reward_mean"] = scores[picked].mean().item()
    extras = {name: torch.cat(values) for name, values in extras.items()}
    for name, values in extras.items():
        if not values.isnan().all():
            metrics[f"val/{name}_mean"] = values.nanmean().item()
    # several val files (e.g. seen and held-out templates of one task) share a data_source: each file apart too
    for file in sorted(set(files)) if len(set(files)) > 1 else ():
        picked = torch.tensor([f == file for f in files])
        metrics[f"val/{file}/reward_mean"] = scores[picked].mean().item()
        for name, values in extras.items():
            if not values[picked].isnan().all():
                metrics[f"val/{file}/{name}_mean"] = values[picked].nanmean().item()
    if tool_counts:
        metrics.update({"val/" + k: v for k, v in tool_rates(tool_counts).items()})
    return metrics


def apply_rollout_correction(cfg: MegarlConfig, batch: dict) -> dict:
    """Engine/trainer mismatch handling (algorithm.rollout_correction): rollout logprobs as old logprobs, truncated
    importance weights, rejection of tokens/sequences with extreme ratios. Adds rollout_is_weights to the batch."""
    rc = cfg.algorithm.rollout_correction
    mask = batch["response_mask"]
    metrics = {}
    if rc.is_level is not None:
        weights, m = algo.rollout_is_weights(batch["old_log_probs"], batch["rollout_log_probs"], mask,
                                             level=rc.is_level, threshold=rc.is_threshold,
                                             threshold_lower=rc.is_threshold_lower,
                                             mode="truncate" if rc.is_threshold_lower is None else "mask")
        batch["rollout_is_weights"] = weights
        metrics.update(_correction_metrics(m))
    if rc.rejection_level is not None:
        keep, m = algo.rollout_rejection_mask(batch["old_log_probs"], batch["rollout_log_probs"], mask,
                                              level=rc.rejection_level, threshold=rc.rejection_threshold,
                                              threshold_lower=rc.rejection_threshold_lower)
        batch["response_mask"] = mask & keep.bool()
        metrics.update(_correction_metrics(m))
    if rc.use_rollout_log_probs:
        batch["old_log_probs"] = batch["rollout_log_probs"].clone()
    return metrics


def _correction_metrics(m: dict) -> dict:
    """rollout_correction/<name>, and verl's rollout_corr/<name> for those verl logs too."""
    out = {f"rollout_correction/{k}": float(v) for k, v in m.items()}
    out.update({f"rollout_corr/{algo.VERL_CORRECTION_NAMES[k]}": float(v) for k, v in m.items()
                if k in algo.VERL_CORRECTION_NAMES})
    return out


class _Started:
    """A generation in flight (EngineGeneration.start / resume): this rank's handle per replica, what each replica
    returned so far (kept when another replica is lost), and how to start some replicas' shares again."""

    def __init__(self, again: Callable[[Optional[set]], list], num_prompts: int):
        self.again, self.num_prompts = again, num_prompts
        self.done: dict = {}  # replica -> its batch (on its owner; None elsewhere)
        self.handles: list = []
        self.lost: Optional[str] = None  # the cause, when this rank's replica was lost starting (multi-turn)
        self.start(None)

    def start(self, replicas: Optional[set]) -> None:
        from megarl.rollout.hosting.supervisor import EngineLost

        try:
            self.handles, self.lost = self.again(replicas), None
        except EngineLost as exc:  # multi-turn rollouts run in start; a lost engine is recovered in finish
            self.handles, self.lost = [], str(exc)

    def collect(self) -> tuple:
        """(this rank's loss cause or None, whether only a replaced engine's stale handle failed, prompts of the lost
        replica's share it still has: EngineLost.kept): every handle's result this rank waits for is kept in `done`."""
        from megarl.rollout.hosting.supervisor import EngineLost

        if self.lost is not None:
            return self.lost, False, 0
        for replica, handle in enumerate(self.handles):
            if handle is None or replica in self.done:
                continue
            try:
                self.done[replica] = handle.result()
            except EngineLost as exc:
                return str(exc), exc.stale, exc.kept
        return None, False, 0


class EngineGeneration:
    """The engines as the rollout schedule drives them (megarl.rollout.schedule.Generation), with restarts of lost
    replicas (rollout.on_engine_failure=restart, megarl.rollout.hosting.supervisor)."""

    def __init__(self, engine, actor, sync, cfg: MegarlConfig, rt: Runtime, offload=None, factory=None):
        from megarl.rollout.hosting.supervisor import RestartBudget, engine_failure_policy

        self.engine, self.actor, self._sync, self.cfg, self.rt = engine, actor, sync, cfg, rt
        self.factory = factory  # the SyncFactory `sync` was planned by: a restart plans again over its holdings
        self.offload = offload  # the trainer's OffloadAroundRollout, or None
        r = cfg.rollout
        # every rank counts every restart of any replica alike: all stop together past a bound
        self.budget = RestartBudget(r.max_engine_restarts, r.engine_restart_window_s, r.max_engine_restarts_per_run)
        self.deliveries = 0  # weight deliveries to the engines so far: their weight version
        self.kept_prompts = 0  # prompts whose samples survived another replica's loss (rollout/prompts_kept_on_loss)
        self.redone_prompts = 0  # prompts generated again after their replica was lost (rollout/prompts_redone)
        self.supervised = engine_failure_policy(cfg) == "restart"  # the same on every rank: a config's choice

    @property
    def restarts(self) -> int:
        """Engine restarts of the run so far (any replica), rollout/engine_restarts."""
        return len(self.budget)

    def start(self, records: Sequence[PromptRecord], seed: Optional[int], **kwargs) -> _Started:
        """kwargs: start_generate's (validate, greedy, multi_turn: by default rollout.multi_turn.enable)."""
        kwargs.setdefault("multi_turn", self.cfg.rollout.multi_turn.enable)
        return _Started(lambda replicas: start_generate(self.engine, records, self.rt, seed=seed, replicas=replicas,
                                                        **kwargs), len(records))

    def generate(self, records: Sequence[PromptRecord], **kwargs) -> RolloutBatch:
        """As megarl.steps.generate (collective), with restarts: kwargs validate, seed, greedy, multi_turn."""
        return self.finish(self.start(records, **kwargs))

    def finish(self, started: _Started) -> RolloutBatch:
        """Wait for a started generation (collective). With rollout.on_engine_failure=restart a lost replica is
        restarted, given the actor's weights, and asked for its share again (the same prompts and seeds); the other
        replicas' samples are kept. Until the batch is complete or the restarts run out."""
        topo = self.rt.engines
        mine = topo.replica_of(self.rt.rank) if self.engine is not None else None
        while True:
            cause, stale, kept = started.collect()
            every = all_gather_objects((mine, cause, stale, kept))  # every rank learns of any loss
            lost = {r: (c, st) for r, c, st, _ in every if c is not None}
            if not lost:
                return combine([broadcast_rollout(started.done.get(r), topo.owner(r), device=compute_device())
                                for r in range(topo.replicas)])
            parts = [topo.prompt_slice(r, started.num_prompts) for r in range(topo.replicas)]
            shares = {r: part.stop - part.start for r, part in enumerate(parts)}
            # a Ray-hosted replica keeps its surviving actors' chunks (`kept`): only the rest is generated again
            still = {r: k for r, c, _, k in every if c is not None}
            self.redone_prompts += sum(shares[r] - still[r] for r in lost)
            self.kept_prompts += sum(n for r, n in shares.items() if r not in lost) + sum(still.values())
            restart = {r: c for r, (c, st) in lost.items() if not st}
            if restart:
                self.recover(restart)
            for r in lost:
                started.done.pop(r, None)
            started.start(set(lost))

    def recover(self, causes: dict) -> dict:
        """Restart the lost replicas ({replica: cause}, the same on every rank; this rank restarts its own), then plan
        the weight sync into the engines as they are now and deliver the weights to the restarted ones only (every
        rank: both are collectives); the sync's metrics."""
        mine = self.rt.engines.replica_of(self.rt.rank) if self.engine is not None else None
        for r, cause in sorted(causes.items()):
            if r == mine:  # killed before anything else: nothing is left running if a bound stops the run here
                self.engine.kill()
            self.budget.take(f"engine replica {r} was lost again {cause}")
            if self.rt.is_rank0:
                log.warning("engine replica %d lost %s: restarting it (restart %d of the run; at most %d within %.0f s)",
                            r, cause, len(self.budget), self.budget.max_restarts, self.budget.window_s)
        if mine in causes:
            self.engine.restart(version=max(0, self.deliveries - 1))
        if hasattr(self._sync, "after_restart"):  # the plan compiled at start: the new engines placed into it
            self._sync.after_restart(self.engine, set(causes))
        else:  # the adapter sync plans again (its base sync and adapters are small)
            self._sync = weight_sync(self.actor, self.engine, self.cfg, self.rt, self.factory)
        metrics = self._deliver(set(causes))
        if not getattr(self._sync, "partial", False) and self.engine is not None:
            # a transport that delivers to every engine counted the survivors' redundant delivery: the version is the
            # trainer's count of deliveries on every engine
            self.engine.set_weight_version(self.deliveries)
        return metrics

    def sync(self) -> dict:
        """Deliver the actor's weights to the engines (collective). An engine replica lost during the delivery (its
        update calls then return at once: megarl.rollout.hosting.supervisor) is restarted and the delivery repeated
        into it."""
        self.deliveries += 1
        return self._deliver(None)

    def _deliver(self, replicas: Optional[set]) -> dict:
        from megarl.sync.transports.remote import EngineHostLost

        try:
            if self.offload is None or not self.offload.active:
                metrics = sync_weights(self.actor, self.engine, self._sync, self.cfg, self.rt, replicas=replicas)
            else:
                self.offload.onload()  # the sync reads the actor's weights
                metrics = sync_weights(self.actor, self.engine, self._sync, self.cfg, self.rt,
                                       before_kv_cache=self.offload.offload, replicas=replicas)
        except EngineHostLost as exc:  # engines placed apart: raised on every rank alike, after the collective part
            if not self.supervised:
                raise
            return self.recover({self.rt.engines.replica_of(o): f"during a weight transfer ({'; '.join(exc.causes)})"
                                 for o in exc.owners})
        if not self.supervised:
            return metrics
        topo = self.rt.engines
        mine = topo.replica_of(self.rt.rank) if self.engine is not None else None
        lost = getattr(self.engine, "lost_in_update", None) if self.engine is not None else None
        causes = {r: c for r, c in all_gather_objects((mine, lost)) if c is not None}  # every rank learns of any loss
        return self.recover(causes) if causes else metrics

    def abort(self) -> None:
        if self.engine is not None:
            self.engine.abort()

    def resume(self, batch: RolloutBatch, rows: list, num_prompts: int, seed: int) -> _Started:
        """Each replica continues the rows of its own share of the prompts (row order is prompt order)."""
        return _Started(lambda replicas: self._continue(batch, rows, num_prompts, seed, replicas), num_prompts)

    def _continue(self, batch: RolloutBatch, rows: list, num_prompts: int, seed: int,
                  replicas: Optional[set]) -> list:
        topo, handles = self.rt.engines, []
        for replica in range(topo.replicas):
            part = topo.prompt_slice(replica, num_prompts)
            handle = None
            if self.engine is not None and topo.replica_of(self.rt.rank) == replica and \
                    (replicas is None or replica in replicas):
                mine = [i for i in rows if part.start <= int(batch.prompt_index[i]) < part.stop]
                handle = self.engine.start_continue([batch.prompt_ids[i] for i in mine],
                                                    [batch.response(i) for i in mine],
                                                    [int(batch.prompt_index[i]) for i in mine],
                                                    [seed + i for i in mine])
            handles.append(handle)
        return handles


def rollout_schedule(cfg: MegarlConfig, loader):
    """trainer.mode's schedule of generations and syncs over the prompt loader; its engines are attached later
    (`schedule.generation = EngineGeneration(...)`), since its checkpointed state loads before they start."""
    from megarl.checkpoint.state import rollout_seed
    from megarl.rollout.schedule import RolloutSchedule, schedule_shape

    at = cfg.async_training
    ahead, staleness = schedule_shape(cfg.trainer.mode, at.max_staleness, at.buffer_size)
    return RolloutSchedule(None, loader, batch_size_drawn(cfg), lambda step: rollout_seed(cfg, step), ahead,
                           staleness, cfg.trainer.total_steps, abort_resume=at.partial_rollout == "abort_resume",
                           response_length=cfg.rollout.response_length)


def batch_size_drawn(cfg: MegarlConfig) -> int:
    """Prompts drawn per generation round: train_batch_size, more with DAPO's over-sampling."""
    fg = cfg.algorithm.filter_groups
    return int(math.ceil(cfg.data.train_batch_size * (1 + cfg.rollout.over_sample_rate))) if fg.enable \
        else cfg.data.train_batch_size


def sample_batch(schedule, step: int, engine, loader, reward_fn, tokenizer, cfg: MegarlConfig, rt: Runtime,
                 timer: Timer, seed: Optional[int] = None, per_sample: Optional[dict] = None):
    """Prompts, rollout and rewards of one step: (records, rollout, scores, metrics). The first round's batch comes
    from the rollout schedule (megarl.rollout.schedule: generated now, or ahead in the async modes).

    With algorithm.filter_groups.enable (DAPO dynamic sampling), batches of train_batch_size * (1 + over_sample_rate)
    prompts are generated until train_batch_size prompts whose samples' metric is not constant are collected: a
    group with all-equal rewards has zero advantage and only dilutes the batch. At most max_num_gen_batches rounds
    (0: no limit); the rounds are reported as dapo/gen_rounds. `seed` makes the step's sampling reproducible (each
    extra round shifts it). per_sample, if given, receives the reward functions' extra per-sample values of the
    returned rows (see `score`)."""
    fg, target, draw = cfg.algorithm.filter_groups, cfg.data.train_batch_size, batch_size_drawn(cfg)
    kept: list[tuple[PromptRecord, RolloutBatch, torch.Tensor, dict]] = []
    rounds, seen_groups = 0, 0
    generated: list[tuple[dict, int]] = []  # each round's rollout/* and reward/* metrics with its sample count
    while True:
        with timer("rollout"):
            if rounds == 0:
                records, rollout, schedule_metrics = schedule.next_batch(step)
            else:  # DAPO's extra rounds (sync mode only: the engines are idle and current)
                records = loader.next_batch(draw)
                rollout = generate(engine, records, rt, seed=None if seed is None else seed + 7919 * rounds,
                                   multi_turn=cfg.rollout.multi_turn.enable)
        extras: dict = {}
        with timer("reward"):
            scores, reward_metrics = score(reward_fn, rollout, records, tokenizer, cfg, rt, per_sample=extras)
        rounds += 1
        if not fg.enable:
            if per_sample is not None:
                per_sample.update(extras)
            return records, rollout, scores, {**reward_metrics, **schedule_metrics}
        generated.append(({**rollout.metrics, **reward_metrics}, len(rollout)))
        metric = extras.get("acc", scores) if fg.metric == "acc" else scores
        keep, m = algo.filter_groups_by_metric(metric, rollout.prompt_index)
        seen_groups += m["num_groups"]
        for group in sorted(set(rollout.prompt_index[keep].tolist())):
            rows = (rollout.prompt_index == group).nonzero().flatten().tolist()
            kept.append((records[group], rollout.select(rows), scores[rows],
                         {k: v[rows] for k, v in extras.items()}))
        if len(kept) >= target:
            break
        if fg.max_num_gen_batches and rounds >= fg.max_num_gen_batches:
            raise RuntimeError(
                f"DAPO dynamic sampling collected {len(kept)} of {target} prompts with non-constant rewards in {rounds} "
                f"generation rounds (algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches}); the "
                "prompts are too easy or too hard for the model: raise max_num_gen_batches or rollout.over_sample_rate,"
                " or change the data")
    kept = kept[:target]
    rollout = RolloutBatch.concat([k[1] for k in kept], prompt_index=list(range(len(kept))))
    scores = torch.cat([k[2] for k in kept])
    if per_sample is not None:
        per_sample.update({name: torch.cat([k[3][name] for k in kept]) for name in kept[0][3]
                           if all(name in k[3] for k in kept)})
    _, final = algo.filter_groups_by_metric(scores, rollout.prompt_index)
    # rollout/* and reward/* describe everything generated in the step's rounds; train/* the kept batch
    every_round = combine_round_metrics(generated)
    if "tool/samples" in every_round:  # multi-turn: the tool/* counts add up over rounds; rates follow from them
        every_round.update(tool_rates(every_round))
    rollout.metrics = {k: v for k, v in every_round.items() if k.startswith("rollout/")}
    metrics = {**{k: v for k, v in every_round.items() if not k.startswith("rollout/")}, **schedule_metrics,
               "dapo/gen_rounds": float(rounds), "dapo/extra_rounds": float(rounds - 1),
               "dapo/kept_group_frac": len(kept) / max(1, seen_groups),
               "dapo/constant_groups": float(final["num_groups"] - final["num_groups_kept"])}
    return [k[0] for k in kept], rollout, scores, metrics
