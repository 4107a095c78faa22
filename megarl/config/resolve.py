"""Derived values and the resolved copy of a config written to the run directory."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from megarl.config.schema import MegarlConfig
from megarl.layout import DeviceShortage, Layout


def resolved_device(setting: str) -> str:
    """trainer.device as the run will use it: auto is cuda when a CUDA device is visible, else cpu."""
    if setting != "auto":
        return setting
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


class _Lines(list):
    """A list written one item a line in the YAML (the engine replicas' GPUs read as a table)."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Lines, lambda dumper, data: dumper.represent_sequence("tag:yaml.org,2002:seq", data,
                                                                                flow_style=False))


def engine_device_lines(cfg: MegarlConfig) -> list:
    """Each engine replica's node and GPUs, one line each, on GPU runs ([] on CPU: the engines take cores there)."""
    if resolved_device(cfg.trainer.device) != "cuda":
        return []
    try:
        return _Lines(d.describe() for d in cfg.engine_devices())
    except DeviceShortage as exc:  # validate refuses the recipe for it; the resolved copy of one says so
        return _Lines([str(exc)])


# What each derived value is, for the configuration reference (tools/config_reference.py; a test checks that every
# key derived() returns is here).
DERIVED_MEANINGS = {
    "world_size": "Training ranks: trainer.nnodes x trainer.n_gpus_per_node.",
    "data_parallel_size": "world_size / (tensor x pipeline x context parallel sizes): the model replicas that split "
                          "each batch.",
    "sequences_per_step": "data.train_batch_size x rollout.n: responses generated and trained on per RL step.",
    "sequences_per_step_per_rank": "sequences_per_step / data_parallel_size.",
    "mini_batches_per_step": "data.train_batch_size / actor.ppo_mini_batch_size: optimizer updates per epoch over "
                             "the step's batch.",
    "mini_batch_sequences_per_rank": "actor.ppo_mini_batch_size x rollout.n / data_parallel_size.",
    "micro_batches_per_mini_batch": "mini_batch_sequences_per_rank / actor.ppo_micro_batch_size_per_gpu (gradient "
                                    "accumulation); null with actor.use_dynamic_bsz (token budgets decide).",
    "optimizer_steps_per_step": "actor.ppo_epochs x mini_batches_per_step: the actor's optimizer steps per RL step.",
    "clip_ratio_low": "The PPO clip's lower epsilon: actor.clip_ratio_low, else actor.clip_ratio.",
    "clip_ratio_high": "The PPO clip's upper epsilon: actor.clip_ratio_high, else actor.clip_ratio.",
    "max_model_len": "The engine's context: rollout.max_model_len, else rollout.prompt_length + "
                     "rollout.response_length.",
    "engine_replicas": "Engine copies serving rollouts: rollout.data_parallel_size, else world_size / "
                       "rollout.tensor_model_parallel_size when colocated, 1 when separate.",
    "engine_placement": "separate with rollout.mode=ray, else rollout.placement, else colocated (engines share "
                        "the trainer's devices).",
    "engine_devices": "GPU runs only: each engine replica's node and GPUs, one line each.",
    "critic_enabled": "Whether a critic trains: critic.enable, else true for algorithm.adv_estimator=gae.",
    "ref_enabled": "Whether the reference model is loaded: ref.enable, else true when a KL term needs it "
                   "(actor.use_kl_loss with actor.kl_loss_coef > 0, or algorithm.use_kl_in_reward).",
    "return_routed_experts": "rollout.return_routed_experts, else true for actor.router_replay.mode=R3: the "
                             "engine returns the experts it routed each token to, for the trainer to replay.",
}


def derived(cfg: MegarlConfig) -> dict:
    """Values computed from the config (never configured twice): DP size, per-rank batch sizes, step counts, the engine
    replicas' GPUs."""
    p, a, n = cfg.parallelism, cfg.actor, cfg.rollout.n
    dp = max(1, cfg.world_size // Layout.of(p).model_parallel_size)
    seqs = cfg.data.train_batch_size * n
    mini_per_rank = a.ppo_mini_batch_size * n // dp
    devices = engine_device_lines(cfg)
    return {
        "world_size": cfg.world_size,
        "data_parallel_size": dp,
        "sequences_per_step": seqs,
        "sequences_per_step_per_rank": seqs // dp,
        "mini_batches_per_step": cfg.data.train_batch_size // a.ppo_mini_batch_size,
        "mini_batch_sequences_per_rank": mini_per_rank,
        "micro_batches_per_mini_batch": None if a.use_dynamic_bsz else mini_per_rank // a.ppo_micro_batch_size_per_gpu,
        "optimizer_steps_per_step": a.ppo_epochs * (cfg.data.train_batch_size // a.ppo_mini_batch_size),
        "clip_ratio_low": a.clip_low,
        "clip_ratio_high": a.clip_high,
        "max_model_len": cfg.rollout.resolved_max_model_len,
        "engine_replicas": cfg.engine_replicas,
        "engine_placement": cfg.engine_placement,
        **({"engine_devices": devices} if devices else {}),
        "critic_enabled": cfg.critic_enabled,
        "ref_enabled": cfg.ref_enabled,
        "return_routed_experts": cfg.routes_from_engine,
    }


def resolved_dict(cfg: MegarlConfig) -> dict:
    out = json.loads(cfg.model_dump_json())
    out["derived"] = derived(cfg)
    return out


def to_yaml(cfg: MegarlConfig) -> str:
    return yaml.dump(resolved_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=None, width=120)


def write_resolved(cfg: MegarlConfig, run_dir: str | Path | None = None) -> Path:
    """Write `<run_dir>/config.resolved.yaml` (the full config plus a `derived` section); return its path."""
    run_dir = Path(run_dir or cfg.trainer.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.resolved.yaml"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_yaml(cfg))
    tmp.replace(path)
    return path
