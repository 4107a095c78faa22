"""The RL loop. Read top to bottom, one step is exactly the data flow of the design:

    prompts -> rollout (vLLM, n samples) -> rewards -> old/ref logprobs, values (megatron forward)
            -> advantages (pure) -> critic and actor updates (megatron) -> weight sync -> metrics

`Trainer.__init__` builds the pieces once (data, reward, models, checkpoint and resume, offload, engine, weight
sync); `Trainer.train_step` is one step of the flow above, and `Trainer.train` runs the steps with validation,
logging and checkpoints between them. Every rank runs this (SPMD); see megarl.runtime for who does what.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

from megarl import algo, lifecycle, runtime, steps
from megarl.agent.tools import load_tools
from megarl.batching import build_train_batch
from megarl.checkpoint.state import Checkpointer, rollout_seed
from megarl.config import MegarlConfig, write_resolved
from megarl.data import PromptLoader, PromptRecord, encode_prompts, format_report, load_prompts_from_config
from megarl.metrics import MetricsLogger, write_rollouts
from megarl.prepare import prepare
from megarl.reward.registry import reward_fn_from_config
from megarl.rollout.threads import keep_trainer_on
from megarl.distributed import barrier, compute_device, node_gpus
from megarl.layout import EngineDevices
from megarl.runtime import Runtime
from megarl.sync.factory import SyncFactory
from megarl.types import RolloutBatch

log = logging.getLogger("megarl")


def train(cfg: MegarlConfig) -> dict:
    """Run the recipe; return the last step's metrics (on rank 0; {} elsewhere). However the run ends (its last step,
    an error on any rank, a signal), the engine is shut down and the process group torn down; an error also stops the
    other ranks within seconds (megarl.lifecycle)."""
    rt = runtime.start(cfg)
    with lifecycle.supervised(teardown=runtime.stop) as cleanups:
        return Trainer(cfg, rt, cleanups).train()


def train_entry(cfg_dict: dict) -> dict:
    """Entry for launched ranks (megarl.launch_local): the config travels as a plain dict."""
    return train(MegarlConfig.model_validate(cfg_dict))


@dataclass
class Scorer:
    """A frozen model's pass over the batch before the advantages: batch[key] = fn(batch, rt), timed as `name`."""
    name: str
    key: str
    fn: Callable


@dataclass
class StepData:
    """One step's samples: the prompts, their rollout and rewards, and the training tensors built from them."""
    records: list[PromptRecord]
    rollout: RolloutBatch
    scores: object  # the rewards, one per sample
    per_sample: dict  # the reward functions' extra per-sample values
    batch: dict
    reward_metrics: dict


class Trainer:
    """The pieces of one run, built once, and its loop. cfg is the run's final config (after prepare() and
    trainer.total_epochs)."""

    def __init__(self, cfg: MegarlConfig, rt: Runtime, cleanups):
        from transformers import AutoTokenizer  # lazy, as megatron's workers and sft: start-up time

        from megarl.sft import sft_model_path

        self.rt = rt
        self.cfg = prepare(cfg, rt.is_rank0)
        barrier()
        if rt.is_rank0:
            write_resolved(self.cfg)
        self.model_path = sft_model_path(self.cfg, rt) if self.cfg.sft.enable else self.cfg.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(self.cfg.model.tokenizer_path or self.model_path,
                                                       trust_remote_code=self.cfg.model.trust_remote_code)
        self._build_data()  # the loader, then self.cfg capped at trainer.total_epochs, then the val records
        self._build_reward(cleanups)
        self._build_models()  # the actor; the reference, teacher and critic as scorers
        self.kl_ctrl = make_kl_controller(self.cfg)
        self.schedule = steps.rollout_schedule(self.cfg, self.loader)  # trainer.mode: which batch is generated when
        self._build_state()  # checkpointer, resume (self.start_step), offload
        self._build_engine(cleanups)  # engine, weight sync, generation
        self.logger = MetricsLogger.for_run(self.cfg, enabled=rt.is_rank0, resume_step=self.start_step)

    # ---- the loop

    def train(self) -> dict:
        """Run the steps from the one after start_step (0 for a fresh run) to trainer.total_steps, or to a stop after
        a SIGTERM; return the last step's metrics on rank 0, {} elsewhere."""
        if self.cfg.trainer.val_before_train and self.val_records and not self.start_step:
            generations: list = []
            self.logger.log(0, self._validate(generations))
            self.logger.log_val_generations(0, generations)
        metrics: dict = {}
        for step in range(self.start_step + 1, self.cfg.trainer.total_steps + 1):
            metrics, data, timer = self.train_step(step)
            generations = self.validate_if_due(step, metrics, timer)
            self.log_step(step, metrics, data, timer, generations)
            if self.checkpoint(step):
                break
        self.ckpt.close()
        self.logger.close()
        if self.engine is not None:
            self.engine.shutdown()
        barrier()
        return metrics if self.rt.is_rank0 else {}

    def train_step(self, step: int) -> tuple[dict, StepData, steps.Timer]:
        """One step of the data flow: (its metrics, its samples, its timer)."""
        cfg, timer = self.cfg, steps.Timer()
        with timer("step"):
            data = self.make_batch(step, timer)
            batch = data.batch
            steps.engine_sleep(self.engine)
            if self.offload.offloaded:
                with timer("onload"):
                    self.offload.onload()
            actor_updates = self.critic is None or step > cfg.critic.warmup_steps
            on_policy = steps.old_log_probs_from_update(cfg, actor_updates)  # else a separate pass computes them
            if not on_policy:
                with timer("old_log_prob"):
                    self.old_log_probs(batch)
            for scorer in self.scorers:  # reference, teacher, critic values: whichever the run has
                with timer(scorer.name):
                    batch[scorer.key] = scorer.fn(batch, self.rt)
            correction_metrics = steps.apply_rollout_correction(cfg, batch)
            adv_metrics = self.advantages(batch)
            with timer("train"):
                train_metrics = self.update(batch, step, actor_updates, on_policy)
            with timer("sync"):  # now in sync mode; in the async modes when no generation is in flight
                sync_metrics = self.schedule.updated()
        rollout = data.rollout
        metrics = {**steps.batch_metrics(batch, rollout, data.scores), **data.reward_metrics, **correction_metrics,
                   **adv_metrics, **train_metrics, **steps.actor_summary(train_metrics), **sync_metrics,
                   **rollout.metrics, "train/epoch": self.loader.epoch,
                   **(self.ref.replay_metrics if self.ref is not None else {})}
        return metrics, data, timer

    # ---- the stages of a step

    def make_batch(self, step: int, timer: steps.Timer) -> StepData:
        """The step's prompts, rollout and rewards (from the rollout schedule), as training tensors with the reward
        components and, for ReMax, each prompt's baseline."""
        cfg, per_sample = self.cfg, {}
        records, rollout, scores, reward_metrics = steps.sample_batch(
            self.schedule, step, self.generation, self.loader, self.reward_fn, self.tokenizer, cfg, self.rt, timer,
            seed=rollout_seed(cfg, step), per_sample=per_sample)
        gen = self.generation
        if gen.restarts:  # engines lost and replaced so far (rollout.on_engine_failure=restart), and the work redone
            reward_metrics.update({"rollout/engine_restarts": float(gen.restarts),
                                   "rollout/prompts_redone": float(gen.redone_prompts),
                                   "rollout/prompts_kept_on_loss": float(gen.kept_prompts)})
        batch = build_train_batch(rollout, scores, self.pad_id)
        if self.images is not None:  # each sample's images beside its tokens, for every forward of the step
            batch.update(self.images.batch_images(records, rollout.prompt_index))
        components = steps.reward_components(cfg, per_sample, len(rollout))
        if components is not None:
            batch["reward_components"] = components
        if cfg.algorithm.adv_estimator == "remax":  # the greedy response's reward is each prompt's baseline
            with timer("remax_baseline"):
                batch["reward_baselines"], baseline_metrics = steps.remax_baselines(
                    self.generation, self.reward_fn, records, rollout, self.tokenizer, cfg, self.rt)
            reward_metrics.update(baseline_metrics)
        return StepData(records, rollout, scores, per_sample, batch, reward_metrics)

    def old_log_probs(self, batch: dict) -> None:
        """The actor's log-probs before its update, in a pass of their own."""
        if self.cfg.algorithm.adv_estimator == "optimal_token_baseline":  # it also reads sum_v pi(v)^2
            batch["old_log_probs"], batch["sum_pi_squared"] = self.actor.log_probs(batch, self.rt, sum_pi_squared=True)
        else:
            batch["old_log_probs"] = self.actor.log_probs(batch, self.rt)

    def advantages(self, batch: dict) -> dict:
        """token_level_rewards, advantages and returns into the batch (the teacher's reverse-KL term added under
        distillation); their metrics."""
        adv_metrics = steps.compute_advantages(self.cfg, batch, self.kl_ctrl)
        if self.teacher is not None:
            adv_metrics.update(steps.add_distillation_advantage(self.cfg, batch))
        return adv_metrics

    def update(self, batch: dict, step: int, actor_updates: bool, on_policy: bool) -> dict:
        """The critic's update, then the actor's (not while the critic warms up, critic.warmup_steps)."""
        train_metrics = self.critic.update(batch, self.rt, step) if self.critic is not None else {}
        if actor_updates:
            train_metrics.update(self.actor.update(batch, self.rt, step, on_policy))
        return train_metrics

    # ---- after a step

    def validate_if_due(self, step: int, metrics: dict, timer: steps.Timer) -> list:
        """Validate every trainer.test_freq steps and at the last, adding to metrics; the validation's first few
        generations for trainer.log_val_generations ([] when this step does not validate)."""
        generations: list = []
        test_freq = self.cfg.trainer.test_freq
        if test_freq and (step % test_freq == 0 or step == self.cfg.trainer.total_steps):
            with timer("val"):  # with the actor's weights: the engines finish what they generate ahead, then sync
                metrics.update(self.schedule.settle())
                metrics.update(self._validate(generations))
        return generations

    def log_step(self, step: int, metrics: dict, data: StepData, timer: steps.Timer, generations: list) -> None:
        """The step's metrics (with offload and timings), validation generations, samples and saved rollouts."""
        self.logger.log(step, {**metrics, **self.offload.metrics(), **timer.metrics()})
        self.logger.log_val_generations(step, generations)
        if self.rt.is_rank0:  # `megarl report` shows the first and the latest step's
            self.logger.log_samples(step, steps.train_samples(data.records, data.rollout, data.scores, self.tokenizer,
                                                              data.per_sample))
        if self.cfg.logging.save_rollouts and self.rt.is_rank0:
            write_rollouts(self.rt.run_dir / "rollouts" / f"step_{step}.jsonl", data.records, data.rollout, data.batch,
                           data.scores, self.tokenizer)

    def checkpoint(self, step: int) -> bool:
        """Save when due (save_freq, last step, SIGTERM); True: stop after a SIGTERM."""
        was_offloaded = self.offload.offloaded
        stop_now = self.ckpt.after_step(step)
        if was_offloaded and not stop_now:
            self.offload.offload()  # a save brought the states back: out again until the next forward
        return stop_now

    def _validate(self, generations: list) -> dict:
        return steps.validate(self.generation, self.reward_fn, self.val_records, self.tokenizer, self.cfg, self.rt,
                              generations)

    # ---- built once, by __init__

    def _build_data(self) -> None:
        tokenizer = self.tokenizer
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.loader = PromptLoader(load_data(self.cfg, tokenizer, "train", self.model_path), seed=self.cfg.trainer.seed,
                                   shuffle=self.cfg.data.shuffle, drop_last=self.cfg.data.drop_last)
        self.cfg = limit_to_epochs(self.cfg, self.loader)
        self.val_records = load_data(self.cfg, tokenizer, "val", self.model_path)
        self.images = None  # a vision-language model's image processor, when the training prompts have images
        if any(r.images for r in self.loader.items):
            from megarl.data.vision import ImagePrompts

            self.images = ImagePrompts(self.model_path, tokenizer)

    def _build_reward(self, cleanups) -> None:
        cfg = self.cfg
        self.reward_fn = reward_fn_from_config(cfg.reward)
        if cfg.reward.reward_model.enable or cfg.reward.judge.enable or cfg.reward.components:  # megarl.reward.combine
            from megarl.reward.combine import StepReward

            self.reward_fn = StepReward(cfg, self.tokenizer, self.reward_fn, self.rt.is_rank0)
            cleanups.callback(self.reward_fn.close)

    def _build_models(self) -> None:
        """The actor and the frozen scorers of each step, in their order: reference, teacher, critic values."""
        from megarl.megatron import workers

        cfg, path = self.cfg, self.model_path
        self.actor = actor = workers.PolicyWorker(path, cfg, trainable=True)
        self.ref = None
        if cfg.ref_enabled:  # with LoRA the reference is the actor's frozen base: its adapters switched off
            self.ref = actor.reference() if cfg.actor.lora.enabled else workers.PolicyWorker(path, cfg, trainable=False)
        self.teacher = None
        if cfg.distillation.enable:  # frozen, colocated like the reference, at the actor's layout
            teacher = cfg.distillation.teacher
            self.teacher = workers.PolicyWorker(teacher.path, cfg, trainable=False,
                                                log_prob_micro_batch_size=teacher.log_prob_micro_batch_size_per_gpu)
            if self.teacher.spec.vocab_size != actor.spec.vocab_size:
                raise ValueError(f"distillation.teacher.path={teacher.path} has a vocabulary of "
                                 f"{self.teacher.spec.vocab_size} tokens, the student {actor.spec.vocab_size}: the "
                                 "teacher must share the student's tokenizer")
        self.critic = workers.CriticWorker(cfg.critic.model_path or path, cfg) if cfg.critic_enabled else None
        self.scorers = []
        if self.ref is not None:
            self.scorers.append(Scorer("ref", "ref_log_probs", self.ref.log_probs))
        if self.teacher is not None:
            self.scorers.append(Scorer("teacher", "teacher_log_probs", self.teacher.log_probs))
        if self.critic is not None:
            self.scorers.append(Scorer("values", "values", self.critic.values))

    def _build_state(self) -> None:
        """The checkpointer and the resume (self.start_step: 0 for a fresh run), then the offload of the states.

        actor/critic/ref.offload: states in host memory from each weight sync to the next forward (and from here to the
        first forward, so the engine starts with their memory free); a checkpoint brings them back to be written."""
        from megarl.megatron.workers import OffloadAroundRollout

        self.ckpt = Checkpointer(self.cfg, self.rt, models={"actor": self.actor, "critic": self.critic},
                                 states={"loader": self.loader, "kl_ctrl": self.kl_ctrl,
                                         "schedule": self.schedule})  # schedule after loader
        self.start_step = self.ckpt.resume()
        self.offload = OffloadAroundRollout(self.cfg, self.actor, self.critic, self.ref)
        if self.offload.active:
            self.ckpt.before_save.append(self.offload.onload)
            self.offload.offload()

    def _build_engine(self, cleanups) -> None:
        """This rank's engine (or None), the weight sync from the actor to it, and the generation over both."""
        cfg, rt = self.cfg, self.rt
        self.engine = start_engine(cfg, self.model_path, rt)
        if compute_device().type == "cpu":
            keep_trainer_on(engine_cores(cfg, trainer_side=True))
        if self.engine is not None:
            cleanups.callback(self.engine.shutdown, timeout_s=5)  # after a failure; a no-op after the shutdown in train
        factory = SyncFactory(self.actor.chunks, self.actor.spec)  # the mapping and holdings, once per run
        sync = steps.weight_sync(self.actor, self.engine, cfg, rt, factory)
        # The engine holds the HF model's weights (or random ones with load_format=dummy): give it the actor's before
        # the first rollout and before val_before_train when they differ (a resume, or dummy weights).
        self.generation = steps.EngineGeneration(self.engine, self.actor, sync, cfg, rt, offload=self.offload,
                                                 factory=factory)
        if self.start_step or cfg.rollout.load_format == "dummy":
            self.generation.sync()
        self.schedule.generation = self.generation
        self.schedule.resumed(self.start_step)


def load_data(cfg: MegarlConfig, tokenizer, split: str, model_path: Optional[str] = None) -> list:
    if split == "val" and not cfg.data.val_files:
        return []
    records = load_prompts_from_config(cfg.data, split, require_data_source=cfg.reward.reward_fn is None)
    mt = cfg.rollout.multi_turn
    tools = load_tools(mt.tool_config_path).schemas() if mt.enable else None  # shown to the model by its template
    images = None
    if any(r.images for r in records):  # prompts with images: their placeholder runs as the model's processor makes
        from megarl.data.vision import ImagePrompts

        images = ImagePrompts(model_path or cfg.model.path, tokenizer)
    records, _, report = encode_prompts(records, tokenizer, cfg.rollout.prompt_length, cfg.data.truncation,
                                        cfg.data.apply_chat_template, tools, images)
    log.info(format_report(report, split))
    return records


def limit_to_epochs(cfg: MegarlConfig, loader: PromptLoader) -> MegarlConfig:
    """The config with trainer.total_steps capped at trainer.total_epochs passes over the training prompts (every
    consumer of total_steps, the LR schedule and the last checkpoint included, then sees the real length)."""
    epochs = cfg.trainer.total_epochs
    total = None if epochs is None else epochs * loader.batches_per_epoch(cfg.data.train_batch_size)
    if total is None or total >= cfg.trainer.total_steps:
        return cfg
    log.info("trainer.total_epochs=%d: %d steps (of trainer.total_steps=%d)", epochs, total, cfg.trainer.total_steps)
    return cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"total_steps": total})})


def make_kl_controller(cfg: MegarlConfig):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return algo.AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return algo.FixedKLController(k.kl_coef)


def start_engine(cfg: MegarlConfig, model_path: str, rt: Runtime):
    """This rank's engine handle: the owner of each engine replica (the first rank of its group) runs one in a child
    process (colocated; with rollout.placement=separate, trainer rank r starts replica r's, on cores of its own); in
    Ray mode rank 0 holds the handle on the Ray actors. None on the other ranks."""
    seed = cfg.rollout.seed if cfg.rollout.seed is not None else cfg.trainer.seed
    # the engine sees only rollout.*: the resolved routed-experts switch (R3 turns it on) travels there
    rollout = cfg.rollout.model_copy(update={"return_routed_experts": cfg.routes_from_engine})
    if cfg.rollout.mode == "ray":
        if not rt.is_rank0:
            return None
        from megarl.rollout.hosting.ray import RayEngine

        from megarl.rollout.hosting.supervisor import engine_failure_policy

        return RayEngine(rollout, model_path, seed=seed,
                         devices=cfg.engine_devices() if compute_device().type == "cuda" else None,
                         restartable=engine_failure_policy(cfg) == "restart",
                         reply_timeout_s=cfg.rollout.engine_timeout_s)
    if not rt.engines.owns(rt.rank):
        return None
    if cfg.engine_placement == "separate" and compute_device().type == "cuda":
        raise RuntimeError("rollout.placement=separate with engine processes started by the trainer runs on CPU; on "
                           "GPU use rollout.mode=ray (engines as Ray actors on GPUs of their own)")
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.rollout.replicas import replica_cores

    # the replicas on this machine split the engines' cores (see engine_cores)
    local = int(os.environ.get("LOCAL_RANK", rt.rank))
    first = rt.rank - local
    on_node = [r for r in range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)))
               if rt.engines.owns(r)]
    cores = replica_cores(engine_cores(cfg), on_node.index(rt.rank), len(on_node),
                          cfg.rollout.tensor_model_parallel_size)
    from megarl.sync.transports.adapter import engine_lora

    replica = rt.engines.replica_of(rt.rank)
    name = f"megarl-{cfg.rollout.name}-engine" + (f"-{replica}" if replica else "")
    # on GPU each replica sees its own GPUs only: the engine would otherwise compute on the node's first ones; on CPU
    # the replica's start line still names its node (torchrun places consecutive ranks on a node)
    devices = (cfg.engine_devices(node_gpus())[replica] if compute_device().type == "cuda" else
               EngineDevices.on_cpu(replica, rt.rank // int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size))))

    def launch():
        return EngineProcess(rollout, model_path, seed=seed, cores=cores, name=name, devices=devices,
                             lora=engine_lora(cfg, model_path), reply_timeout_s=cfg.rollout.engine_timeout_s)

    from megarl.rollout.hosting.supervisor import EngineSupervisor, engine_failure_policy

    if engine_failure_policy(cfg) != "restart":
        return launch()
    return EngineSupervisor(launch, name=f"engine replica {replica}", replica=replica)


def engine_cores(cfg: MegarlConfig, trainer_side: bool = False) -> list:
    """The CPU cores of this machine for its engines (or, trainer_side, for the trainer's ranks): all of them for both
    when they take turns (sync mode, colocated), their own share for each when they overlap (the async modes, or
    engines placed separately): rollout.engine_cpu_cores, default half."""
    from megarl.rollout.threads import available_cores, split_cores

    overlap = cfg.trainer.mode != "sync" or cfg.engine_placement == "separate"
    split = split_cores(available_cores(), cfg.rollout.engine_cpu_cores, overlap)
    return split[1] if trainer_side else split[0]
