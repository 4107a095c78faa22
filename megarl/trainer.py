"""The RL loop. Read top to bottom, one step is exactly the data flow of the design:

    prompts -> rollout (vLLM, n samples) -> rewards -> old/ref logprobs, values (megatron forward)
            -> advantages (pure) -> critic and actor updates (megatron) -> weight sync -> metrics

Every rank runs this function (SPMD); see megarl.runtime for who does what.
"""
from __future__ import annotations

import logging
import os

from megarl import algo, lifecycle, steps
from megarl.agent.tools import load_tools
from megarl.batching import build_train_batch
from megarl.checkpoint.state import Checkpointer, rollout_seed
from megarl.config import MegarlConfig, write_resolved
from megarl.data import PromptLoader, encode_prompts, format_report, load_prompts_from_config
from megarl.metrics import MetricsLogger, write_rollouts
from megarl.prepare import prepare
from megarl.reward.registry import reward_fn_from_config
from megarl.rollout.threads import keep_trainer_on
from megarl.distributed import barrier, compute_device, node_gpus
from megarl.runtime import Runtime, start, stop

log = logging.getLogger("megarl")


def load_data(cfg: MegarlConfig, tokenizer, split: str) -> list:
    if split == "val" and not cfg.data.val_files:
        return []
    records = load_prompts_from_config(cfg.data, split, require_data_source=cfg.reward.reward_fn is None)
    mt = cfg.rollout.multi_turn
    tools = load_tools(mt.tool_config_path).schemas() if mt.enable else None  # shown to the model by its template
    records, _, report = encode_prompts(records, tokenizer, cfg.rollout.prompt_length, cfg.data.truncation,
                                        cfg.data.apply_chat_template, tools)
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
        from megarl.rollout.ray_engine import RayEngine

        return RayEngine(rollout, model_path, seed=seed,
                         devices=cfg.engine_devices() if compute_device().type == "cuda" else None)
    if not rt.engines.owns(rt.rank):
        return None
    if cfg.engine_placement == "separate" and compute_device().type == "cuda":
        raise RuntimeError("rollout.placement=separate with engine processes started by the trainer runs on CPU; on "
                           "GPU use rollout.mode=ray (engines as Ray actors on GPUs of their own)")
    from megarl.rollout.process import EngineProcess
    from megarl.rollout.replicas import replica_cores

    # the replicas on this machine split the engines' cores (see engine_cores)
    local = int(os.environ.get("LOCAL_RANK", rt.rank))
    first = rt.rank - local
    on_node = [r for r in range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", rt.world_size)))
               if rt.engines.owns(r)]
    cores = replica_cores(engine_cores(cfg), on_node.index(rt.rank), len(on_node),
                          cfg.rollout.tensor_model_parallel_size)
    from megarl.sync.adapters import engine_lora

    replica = rt.engines.replica_of(rt.rank)
    name = f"megarl-{cfg.rollout.name}-engine" + (f"-{replica}" if replica else "")
    # on GPU each replica sees its own GPUs only: the engine would otherwise compute on the node's first ones
    devices = cfg.engine_devices(node_gpus())[replica] if compute_device().type == "cuda" else None

    def start():
        return EngineProcess(rollout, model_path, seed=seed, cores=cores, name=name, devices=devices,
                             lora=engine_lora(cfg, model_path), reply_timeout_s=cfg.rollout.engine_timeout_s)

    from megarl.rollout.supervisor import EngineSupervisor, engine_failure_policy

    if engine_failure_policy(cfg) != "restart":
        return start()
    return EngineSupervisor(start, cfg.rollout.max_engine_restarts, cfg.rollout.engine_restart_window_s,
                            name=f"engine replica {replica}")


def engine_cores(cfg: MegarlConfig, trainer_side: bool = False) -> list:
    """The CPU cores of this machine for its engines (or, trainer_side, for the trainer's ranks): all of them for both
    when they take turns (sync mode, colocated), their own share for each when they overlap (the async modes, or
    engines placed separately): rollout.engine_cpu_cores, default half."""
    from megarl.rollout.threads import available_cores, split_cores

    overlap = cfg.trainer.mode != "sync" or cfg.engine_placement == "separate"
    split = split_cores(available_cores(), cfg.rollout.engine_cpu_cores, overlap)
    return split[1] if trainer_side else split[0]


def train(cfg: MegarlConfig) -> dict:
    """Run the recipe; return the last step's metrics (on rank 0; {} elsewhere). However the run ends (its last step,
    an error on any rank, a signal), the engine is shut down and the process group torn down; an error also stops the
    other ranks within seconds (megarl.lifecycle)."""
    rt = start(cfg)
    with lifecycle.supervised(teardown=stop) as cleanups:
        return _train(cfg, rt, cleanups)


def _train(cfg: MegarlConfig, rt: Runtime, cleanups) -> dict:
    from transformers import AutoTokenizer

    from megarl.megatron.workers import CriticWorker, OffloadAroundRollout, PolicyWorker
    from megarl.sft import sft_model_path

    cfg = prepare(cfg, rt.is_rank0)
    barrier()
    if rt.is_rank0:
        write_resolved(cfg)
    model_path = sft_model_path(cfg, rt) if cfg.sft.enable else cfg.model.path
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or model_path,
                                              trust_remote_code=cfg.model.trust_remote_code)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loader = PromptLoader(load_data(cfg, tokenizer, "train"), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle,
                          drop_last=cfg.data.drop_last)
    cfg = limit_to_epochs(cfg, loader)
    val_records = load_data(cfg, tokenizer, "val")
    reward_fn = reward_fn_from_config(cfg.reward)

    if cfg.reward.reward_model.enable or cfg.reward.judge.enable or cfg.reward.components:  # megarl.reward.combine
        from megarl.reward.combine import StepReward

        reward_fn = StepReward(cfg, tokenizer, reward_fn, rt.is_rank0)
        cleanups.callback(reward_fn.close)
    actor = PolicyWorker(model_path, cfg, trainable=True)
    ref = None
    if cfg.ref_enabled:  # with LoRA the reference is the actor's frozen base: its adapters switched off
        ref = actor.reference() if cfg.actor.lora.enabled else PolicyWorker(model_path, cfg, trainable=False)
    teacher = None
    if cfg.distillation.enable:  # frozen, colocated like the reference, at the actor's layout
        teacher = PolicyWorker(cfg.distillation.teacher.path, cfg, trainable=False,
                               log_prob_micro_batch_size=cfg.distillation.teacher.log_prob_micro_batch_size_per_gpu)
        if teacher.spec.vocab_size != actor.spec.vocab_size:
            raise ValueError(f"distillation.teacher.path={cfg.distillation.teacher.path} has a vocabulary of "
                             f"{teacher.spec.vocab_size} tokens, the student {actor.spec.vocab_size}: the teacher must "
                             "share the student's tokenizer")
    critic = CriticWorker(cfg.critic.model_path or model_path, cfg) if cfg.critic_enabled else None
    kl_ctrl = make_kl_controller(cfg)
    schedule = steps.rollout_schedule(cfg, loader)  # trainer.mode: which batch is generated when, by which weights
    ckpt = Checkpointer(cfg, rt, models={"actor": actor, "critic": critic},
                        states={"loader": loader, "kl_ctrl": kl_ctrl, "schedule": schedule})  # schedule after loader
    start_step = ckpt.resume()  # 0 for a fresh run
    # actor/critic/ref.offload: states in host memory from each weight sync to the next forward (and from here to the
    # first forward, so the engine starts with their memory free); a checkpoint brings them back to be written
    offload = OffloadAroundRollout(cfg, actor, critic, ref)
    if offload.active:
        ckpt.before_save.append(offload.onload)
        offload.offload()
    engine = start_engine(cfg, model_path, rt)
    if compute_device().type == "cpu":
        keep_trainer_on(engine_cores(cfg, trainer_side=True))
    if engine is not None:
        cleanups.callback(engine.shutdown, timeout_s=5)  # after a failure; a no-op after the shutdown below
    sync = steps.weight_sync(actor, engine, cfg, rt)
    # The engine holds the HF model's weights (or random ones with load_format=dummy): give it the actor's before the
    # first rollout and before val_before_train when they differ (a resume, or dummy weights).
    generation = steps.EngineGeneration(engine, actor, sync, cfg, rt, offload=offload)
    if start_step or cfg.rollout.load_format == "dummy":
        generation.sync()
    schedule.generation = generation
    schedule.resumed(start_step)
    logger = MetricsLogger.for_run(cfg, enabled=rt.is_rank0, resume_step=start_step)
    if cfg.trainer.val_before_train and val_records and not start_step:
        generations: list = []
        logger.log(0, steps.validate(engine, reward_fn, val_records, tokenizer, cfg, rt, generations))
        logger.log_val_generations(0, generations)

    metrics: dict = {}
    for step in range(start_step + 1, cfg.trainer.total_steps + 1):
        timer = steps.Timer()
        with timer("step"):
            per_sample: dict = {}
            records, rollout, scores, reward_metrics = steps.sample_batch(
                schedule, step, engine, loader, reward_fn, tokenizer, cfg, rt, timer, seed=rollout_seed(cfg, step),
                per_sample=per_sample)
            if generation.restarts:  # engines lost and replaced so far (rollout.on_engine_failure=restart)
                reward_metrics["rollout/engine_restarts"] = float(generation.restarts)
            batch = build_train_batch(rollout, scores, pad_id)
            components = steps.reward_components(cfg, per_sample, len(rollout))
            if components is not None:
                batch["reward_components"] = components
            if cfg.algorithm.adv_estimator == "remax":  # the greedy response's reward is each prompt's baseline
                with timer("remax_baseline"):
                    batch["reward_baselines"], baseline_metrics = steps.remax_baselines(
                        engine, reward_fn, records, rollout, tokenizer, cfg, rt)
                reward_metrics.update(baseline_metrics)
            steps.engine_sleep(engine)
            if offload.offloaded:
                with timer("onload"):
                    offload.onload()
            actor_updates = critic is None or step > cfg.critic.warmup_steps
            on_policy = steps.old_log_probs_from_update(cfg, actor_updates)  # else a separate pass computes them
            if not on_policy:
                with timer("old_log_prob"):
                    if cfg.algorithm.adv_estimator == "optimal_token_baseline":  # it also reads sum_v pi(v)^2
                        batch["old_log_probs"], batch["sum_pi_squared"] = actor.log_probs(batch, rt,
                                                                                         sum_pi_squared=True)
                    else:
                        batch["old_log_probs"] = actor.log_probs(batch, rt)
            if ref is not None:
                with timer("ref"):
                    batch["ref_log_probs"] = ref.log_probs(batch, rt)
            if teacher is not None:
                with timer("teacher"):
                    batch["teacher_log_probs"] = teacher.log_probs(batch, rt)
            if critic is not None:
                with timer("values"):
                    batch["values"] = critic.values(batch, rt)
            correction_metrics = steps.apply_rollout_correction(cfg, batch)
            adv_metrics = steps.compute_advantages(cfg, batch, kl_ctrl)
            if teacher is not None:
                adv_metrics.update(steps.add_distillation_advantage(cfg, batch))
            with timer("train"):
                train_metrics = critic.update(batch, rt, step) if critic is not None else {}
                if actor_updates:
                    train_metrics.update(actor.update(batch, rt, step, on_policy))
            with timer("sync"):  # now in sync mode; in the async modes when no generation is in flight
                sync_metrics = schedule.updated()
        metrics = {**steps.batch_metrics(batch, rollout, scores), **reward_metrics, **correction_metrics,
                   **adv_metrics, **train_metrics, **steps.actor_summary(train_metrics), **sync_metrics,
                   **rollout.metrics, "train/epoch": loader.epoch,
                   **(ref.replay_metrics if ref is not None else {})}
        generations = []  # the validation's first few, when this step validates (trainer.log_val_generations)
        if cfg.trainer.test_freq and (step % cfg.trainer.test_freq == 0 or step == cfg.trainer.total_steps):
            with timer("val"):  # with the actor's weights: the engines finish what they generate ahead, then sync
                metrics.update(schedule.settle())
                metrics.update(steps.validate(engine, reward_fn, val_records, tokenizer, cfg, rt, generations))
        logger.log(step, {**metrics, **offload.metrics(), **timer.metrics()})
        logger.log_val_generations(step, generations)
        if rt.is_rank0:  # `megarl report` shows the first and the latest step's
            logger.log_samples(step, steps.train_samples(records, rollout, scores, tokenizer, per_sample))
        if cfg.logging.save_rollouts and rt.is_rank0:
            write_rollouts(rt.run_dir / "rollouts" / f"step_{step}.jsonl", records, rollout, batch, scores, tokenizer)
        was_offloaded = offload.offloaded
        stop = ckpt.after_step(step)  # saves when due (save_freq, last step, SIGTERM); True: stop after a SIGTERM
        if was_offloaded and not stop:
            offload.offload()  # a save brought the states back: out again until the next forward
        if stop:
            break
    ckpt.close()
    logger.close()
    if engine is not None:
        engine.shutdown()
    barrier()
    return metrics if rt.is_rank0 else {}


def train_entry(cfg_dict: dict) -> dict:
    """Entry for launched ranks (megarl.launch_local): the config travels as a plain dict."""
    return train(MegarlConfig.model_validate(cfg_dict))
