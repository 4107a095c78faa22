"""megarl beside TRL's GRPOTrainer on one recipe: the same model, prompts (in the same order), reward, batch, group
size, lengths, learning rate and steps, on CPU, each side in a child process of its own.

    .venv/bin/python bench/bench_trl.py                                   # recipes/grpo_smollm2_cpu.yaml, its steps
    .venv/bin/python bench/bench_trl.py --steps 20 --seeds 1 2 3 --out runs/bench_trl
    .venv/bin/python bench/bench_trl.py --side trl --steps 1 --val-limit 4 data.train_batch_size=2 rollout.n=2
    make bench-trl [TRL_RECIPE=...] [STEPS=20] [SEEDS="1 2 3"] [ARGS="k=v ..."]

The recipe is read with megarl's own loader (megarl.validate.load_config) and TRL's GRPOConfig is derived from it
(`grpo_config_kwargs`), so the two sides cannot drift; trailing `section.key=value` overrides apply to both. A recipe
setting TRL has no counterpart for is refused before anything runs (`unmatchable`); what runs but still differs is
printed (`unequal_notes`).

megarl: `megarl train RECIPE trainer.run_dir=... trainer.seed=S trainer.total_steps=N` (in-run validation off unless
--megarl-own-val), its metrics.jsonl read for the steps and phases; its final checkpoint merged to a Hugging Face
directory (`megarl merge`). TRL: this file with --trl-runner, GRPOTrainer(use_vllm=False) on CPU in float32, the
training prompts written in exactly the order megarl's loader draws them (shuffle_dataset=False), the reward megarl's
own (RewardRouter -> megarl.reward.rules.gsm8k for openai/gsm8k rows), its final model saved. Both final models and the
initial one are then scored the same way (--score-model): greedy HF generate at rollout.response_length on the
recipe's validation prompts as megarl encodes them, scored by megarl's reward code.

Reported per side and seed: seconds per RL step (median over the steps after the first; wall time between step ends),
seconds per 1k generated tokens, peak memory of the process tree (psutil, sampled every 0.5 s: sum of RSS, and of PSS,
which counts pages shared between processes once), validation accuracy before -> after, the update's achieved FLOP/s
against this machine's measured float32 matmul rate, and megarl's phases (timing/*_s). Then the medians over seeds and
the ratio megarl / TRL. The table is printed and everything is written to OUT/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from statistics import median
from typing import Any, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

DEFAULT_RECIPE = ROOT / "recipes" / "grpo_smollm2_cpu.yaml"
TRL_VERSION = "1.16.0"  # GRPOConfig's fields below are TRL 1.16's (setup.py extra `trl`)

# megarl's loss aggregation -> TRL's loss_type (TRL/trainer/grpo_trainer.py, _compute_loss)
LOSS_TYPES = {
    "token-mean": "dapo",  # sum over tokens / tokens per mini-batch
    "seq-mean-token-mean": "grpo",  # per-sequence token mean, mean over sequences
    "seq-mean-token-sum-norm": "dr_grpo",  # per-sequence token sum / max response length, mean over sequences
}
K3_NAMES = ("low_var_kl", "k3")  # TRL's KL term is Schulman's k3: exp(ref - logp) - (ref - logp) - 1
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
BF16_OVERRIDES = ("model.dtype=bfloat16", "rollout.dtype=bfloat16")  # --bf16 on megarl's side, where it validates

FLOP_FORMULA = ("update FLOPs per RL step = 6 * P * T * ppo_epochs (forward + backward of every trained token) "
                "+ 2 * P * T * F (forward-only logprob passes: F = 1 for a separate old-logprob pass, + 1 for the "
                "reference when the KL loss is on); P = model parameters (tied embeddings once), T = prompt + "
                "response tokens of the step's B*n sequences (real tokens, no padding; attention's T^2 term left out); "
                "achieved FLOP/s = that / the update's seconds (megarl: timing/train_s + old_log_prob_s + ref_s; "
                "TRL: step - generate - reward seconds)")


class Unmatchable(ValueError):
    """The recipe uses a setting TRL's GRPOTrainer has no counterpart for: a comparison would not be like for like."""


# ---------------------------------------------------------------------------------------------------------------------
# Pure parts: the recipe -> GRPOConfig mapping, what stays unequal, FLOPs, summaries, the table
# ---------------------------------------------------------------------------------------------------------------------

def _clip(a) -> tuple[float, float]:
    low = a.clip_ratio_low if a.clip_ratio_low is not None else a.clip_ratio
    high = a.clip_ratio_high if a.clip_ratio_high is not None else a.clip_ratio
    return low, high


def updates_per_step(cfg) -> int:
    """Optimizer steps per RL step: mini-batches per batch times ppo_epochs."""
    return cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size * cfg.actor.ppo_epochs


def separate_old_logprob_pass(cfg) -> bool:
    """Both sides skip the old-logprob forward exactly when a batch gets one optimizer step (megarl's
    steps.old_log_probs_from_update for the settings `unmatchable` lets through; TRL: num_iterations == 1 and
    steps_per_generation <= gradient_accumulation_steps)."""
    return updates_per_step(cfg) > 1


def unmatchable(cfg) -> list[str]:
    """Recipe settings GRPOTrainer cannot reproduce (each: key = value, why). Empty: the mapping is complete."""
    a, r, alg = cfg.actor, cfg.rollout, cfg.algorithm
    out = []

    def refuse(key, value, why):
        out.append(f"{key} = {value!r}: {why}")

    if cfg.trainer.mode != "sync":
        refuse("trainer.mode", cfg.trainer.mode, "TRL generates with the current weights only (use sync)")
    if cfg.world_size != 1:
        refuse("trainer.n_gpus_per_node * nnodes", cfg.world_size, "the TRL side runs as one CPU process")
    if alg.adv_estimator not in ("grpo", "drgrpo"):
        refuse("algorithm.adv_estimator", alg.adv_estimator, "GRPOTrainer has group-relative advantages only "
               "(grpo, or drgrpo = scale_rewards none)")
    if a.policy_loss != "vanilla":
        refuse("actor.policy_loss", a.policy_loss, "only vanilla (PPO clip) is mapped")
    if a.loss_agg_mode not in LOSS_TYPES:
        refuse("actor.loss_agg_mode", a.loss_agg_mode, f"TRL's loss types cover {', '.join(LOSS_TYPES)}")
    if cfg.kl_loss_active and a.kl_loss_type not in K3_NAMES:
        refuse("actor.kl_loss_type", a.kl_loss_type, "TRL's KL loss is k3 (low_var_kl) only")
    if cfg.kl_in_reward_active:
        refuse("algorithm.use_kl_in_reward", True, "TRL has no KL penalty in the reward")
    if a.entropy_coeff:
        refuse("actor.entropy_coeff", a.entropy_coeff, "not mapped")
    if alg.filter_groups.enable:
        refuse("algorithm.filter_groups.enable", True, "TRL has no dynamic sampling")
    if cfg.critic_enabled:
        refuse("critic.enable", True, "GRPOTrainer has no critic")
    rc = alg.rollout_correction
    if rc.is_level is not None or rc.rejection_level is not None or rc.use_rollout_log_probs:
        refuse("algorithm.rollout_correction", "set", "TRL's importance-sampling correction is vLLM's only")
    if r.n < 2:
        refuse("rollout.n", r.n, "GRPOTrainer needs num_generations >= 2")
    if not r.do_sample or r.temperature == 0:
        refuse("rollout.do_sample/temperature", (r.do_sample, r.temperature), "TRL always samples")
    if r.multi_turn.enable:
        refuse("rollout.multi_turn.enable", True, "not mapped")
    if r.stop or r.stop_token_ids or r.ignore_eos:
        refuse("rollout.stop/stop_token_ids/ignore_eos", "set", "not mapped")
    if cfg.model.dtype == "float16":
        refuse("model.dtype", cfg.model.dtype, "only float32 and bfloat16 are mapped")
    if a.lora.rank:
        refuse("actor.lora.rank", a.lora.rank, "not mapped")
    if cfg.reward.reward_model.enable or cfg.reward.judge.enable or cfg.reward.components:
        refuse("reward", "model/judge/components", "only rule rewards are mapped")
    if cfg.distillation.enable:
        refuse("distillation.enable", True, "not mapped")
    if cfg.data.train_batch_size % a.ppo_mini_batch_size:
        refuse("actor.ppo_mini_batch_size", a.ppo_mini_batch_size, "must divide data.train_batch_size")
    return out


def lr_schedule(optim) -> tuple[str, dict]:
    """megarl's (megatron's) LR schedule -> (TrainingArguments.lr_scheduler_type, lr_scheduler_kwargs)."""
    style = optim.lr_decay_style
    if style == "constant":
        return ("constant_with_warmup" if optim.lr_warmup_steps else "constant"), {}
    if style == "linear":
        return ("linear", {}) if not optim.min_lr else ("polynomial", {"lr_end": optim.min_lr, "power": 1.0})
    if style == "cosine":
        return "cosine_with_min_lr", {"min_lr": optim.min_lr}
    raise Unmatchable(f"actor.optim.lr_decay_style = {style!r}: not mapped")


def dynamic_micro_batch(cfg) -> int:
    """TRL's fixed micro-batch for megarl's token-budget micro-batches (actor.use_dynamic_bsz): the most sequences of
    the longest possible length (prompt_length + response_length) within ppo_max_token_len_per_gpu, lowered to a
    divisor of the mini-batch (at least 1)."""
    a, r = cfg.actor, cfg.rollout
    mini_seqs = a.ppo_mini_batch_size * r.n
    fit = max(1, a.ppo_max_token_len_per_gpu // (r.prompt_length + r.response_length))
    return max(d for d in range(1, min(fit, mini_seqs) + 1) if mini_seqs % d == 0)


def grpo_config_kwargs(cfg, output_dir: str, steps: int, seed: int) -> dict[str, Any]:
    """GRPOConfig(**kwargs) reproducing the recipe `cfg` (a MegarlConfig) for `steps` RL steps on CPU in float32.

    One RL step of megarl = B prompts x n samples generated at once, then B/M mini-batches of M*n sequences (one
    optimizer step each), ppo_epochs times. TRL's "steps_per_generation" counts micro-batches (forward/backward
    calls), so: per_device_train_batch_size = the micro-batch, gradient_accumulation_steps = micro-batches per
    mini-batch, steps_per_generation = micro-batches per batch (generation_batch_size = B*n), num_iterations =
    ppo_epochs, max_steps = optimizer steps = steps * B/M * ppo_epochs."""
    problems = unmatchable(cfg)
    if problems:
        raise Unmatchable("; ".join(problems))
    a, r, o = cfg.actor, cfg.rollout, cfg.actor.optim
    batch, n, mini = cfg.data.train_batch_size, r.n, a.ppo_mini_batch_size
    mini_seqs = mini * n
    micro = dynamic_micro_batch(cfg) if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu
    if mini_seqs % micro:
        raise Unmatchable(f"actor.ppo_micro_batch_size_per_gpu = {micro} does not divide the mini-batch of "
                          f"{mini_seqs} sequences")
    accumulation = mini_seqs // micro
    low, high = _clip(a)
    scheduler, scheduler_kwargs = lr_schedule(o)
    scale = "group" if cfg.algorithm.adv_estimator == "grpo" and cfg.algorithm.norm_adv_by_std_in_grpo else "none"
    kwargs = {
        "output_dir": output_dir,
        # GRPOConfig defaults bf16=True; float32 unless the recipe trains in bfloat16 (--bf16 sets model.dtype)
        "use_cpu": True, "bf16": cfg.model.dtype == "bfloat16", "fp16": False,
        "seed": seed, "data_seed": seed,
        "max_steps": steps * updates_per_step(cfg),
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": accumulation,
        "steps_per_generation": accumulation * (batch // mini),
        "num_generations": n,
        "num_iterations": a.ppo_epochs,
        "shuffle_dataset": False,  # the dataset is written in megarl's draw order
        "max_completion_length": r.response_length,
        "temperature": r.temperature,
        "top_p": r.top_p,
        "top_k": r.top_k if r.top_k > 0 else 0,  # megarl -1 / TRL 0: off
        "repetition_penalty": r.repetition_penalty,
        "loss_type": LOSS_TYPES[a.loss_agg_mode],
        "beta": a.kl_loss_coef if cfg.kl_loss_active else 0.0,
        "epsilon": low,
        "epsilon_high": high,
        "scale_rewards": scale,
        "mask_truncated_completions": False,  # megarl trains on truncated responses too
        "learning_rate": o.lr,
        "lr_scheduler_type": scheduler,
        "warmup_steps": o.lr_warmup_steps,
        "optim": "adamw_torch",
        "adam_beta1": o.betas[0],
        "adam_beta2": o.betas[1],
        "adam_epsilon": o.eps,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.clip_grad,
        "gradient_checkpointing": cfg.model.recompute != "none",  # GRPOConfig defaults it on; megarl's recompute
        "disable_dropout": True,  # megarl builds its models with dropout 0
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "remove_unused_columns": False,
        "dataloader_num_workers": 0,
    }
    if scheduler_kwargs:
        kwargs["lr_scheduler_kwargs"] = scheduler_kwargs
    return kwargs


def settings_table(cfg, kwargs: dict) -> list[tuple[str, Any, str]]:
    """(TRL setting, value, the megarl recipe value it comes from) for the output and the docs."""
    a, r, o = cfg.actor, cfg.rollout, cfg.actor.optim
    low, high = _clip(a)
    b, n, m = cfg.data.train_batch_size, r.n, a.ppo_mini_batch_size
    micro = (f"use_dynamic_bsz: ppo_max_token_len_per_gpu {a.ppo_max_token_len_per_gpu} // (prompt_length + "
             f"response_length), a divisor of the mini-batch" if a.use_dynamic_bsz else a.ppo_micro_batch_size_per_gpu)
    return [
        ("loss_type", kwargs["loss_type"], f"actor.loss_agg_mode={a.loss_agg_mode}"),
        ("beta", kwargs["beta"], f"actor.use_kl_loss={a.use_kl_loss} kl_loss_coef={a.kl_loss_coef} "
                                 f"kl_loss_type={a.kl_loss_type}"),
        ("num_iterations", kwargs["num_iterations"], f"actor.ppo_epochs={a.ppo_epochs}"),
        ("scale_rewards", kwargs["scale_rewards"], f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} "
                                                   f"norm_adv_by_std_in_grpo={cfg.algorithm.norm_adv_by_std_in_grpo}"),
        ("epsilon / epsilon_high", f"{kwargs['epsilon']} / {kwargs['epsilon_high']}",
         f"actor.clip_ratio_low/high={low}/{high}"),
        ("num_generations", kwargs["num_generations"], f"rollout.n={n}"),
        ("generation_batch_size", b * n, f"data.train_batch_size * rollout.n = {b} * {n} (derived by TRL)"),
        ("per_device_train_batch_size", kwargs["per_device_train_batch_size"],
         f"actor.ppo_micro_batch_size_per_gpu ({micro})"),
        ("gradient_accumulation_steps", kwargs["gradient_accumulation_steps"],
         f"actor.ppo_mini_batch_size * rollout.n / micro = {m} * {n} / {kwargs['per_device_train_batch_size']}"),
        ("steps_per_generation", kwargs["steps_per_generation"],
         f"micro-batches per RL step = train_batch_size / ppo_mini_batch_size * accumulation = {b} / {m} * "
         f"{kwargs['gradient_accumulation_steps']}"),
        ("max_steps", kwargs["max_steps"], f"RL steps * {updates_per_step(cfg)} optimizer steps each"),
        ("max_prompt_length", "(none in TRL 1.16)", f"rollout.prompt_length={r.prompt_length} "
                                                    f"data.truncation={cfg.data.truncation}: megarl's encoded "
                                                    "prompts are the dataset of both sides"),
        ("max_completion_length", kwargs["max_completion_length"], f"rollout.response_length={r.response_length}"),
        ("temperature / top_p / top_k", f"{kwargs['temperature']} / {kwargs['top_p']} / {kwargs['top_k']}",
         f"rollout.temperature/top_p/top_k={r.temperature}/{r.top_p}/{r.top_k}"),
        ("repetition_penalty", kwargs["repetition_penalty"], f"rollout.repetition_penalty={r.repetition_penalty}"),
        ("learning_rate", kwargs["learning_rate"], f"actor.optim.lr={o.lr}"),
        ("lr_scheduler_type (kwargs) / warmup_steps",
         f"{kwargs['lr_scheduler_type']} {kwargs.get('lr_scheduler_kwargs', {})} / {kwargs['warmup_steps']}",
         f"actor.optim.lr_decay_style={o.lr_decay_style} min_lr={o.min_lr} lr_warmup_steps={o.lr_warmup_steps}"),
        ("optim, adam_beta1/2, adam_epsilon, weight_decay",
         f"{kwargs['optim']}, {kwargs['adam_beta1']}/{kwargs['adam_beta2']}, {kwargs['adam_epsilon']}, "
         f"{kwargs['weight_decay']}", f"megatron Adam (decoupled decay) betas={tuple(o.betas)} eps={o.eps} "
                                      f"weight_decay={o.weight_decay}; neither decays biases or norms"),
        ("max_grad_norm", kwargs["max_grad_norm"], f"actor.optim.clip_grad={o.clip_grad}"),
        ("gradient_checkpointing", kwargs["gradient_checkpointing"], f"model.recompute={cfg.model.recompute}"),
        ("seed / data order", f"seed={kwargs['seed']}, shuffle_dataset=False",
         "trainer.seed; prompts in megarl's PromptLoader order"),
        ("bf16 / fp16 / use_cpu", f"{kwargs['bf16']} / {kwargs['fp16']} / {kwargs['use_cpu']}",
         f"model.dtype={cfg.model.dtype} rollout.dtype={r.dtype} (auto: float32 on CPU)"),
        ("mask_truncated_completions", kwargs["mask_truncated_completions"], "megarl trains on truncated responses"),
        ("reward_funcs", "megarl_reward (this file)", "megarl's RewardRouter by data_source, reward.reward_kwargs"
         + (f", plus reward.overlong_buffer (len {cfg.reward.overlong_buffer.len}, penalty_factor "
            f"{cfg.reward.overlong_buffer.penalty_factor}) by megarl.algo.overlong_reward_penalty on the completion's "
            "token count" if cfg.reward.overlong_buffer.enable else "")),
    ]


def unequal_notes(cfg) -> list[str]:
    """What still differs between the two sides after the mapping (printed with every run)."""
    a, r = cfg.actor, cfg.rollout
    notes = [
        "sampling: megarl samples with vLLM (continuous batching, its own RNG and kernels), TRL with transformers' "
        "generate over one padded batch of B*n rows; same temperature/top_p/top_k, different random streams, so the "
        "responses (and their lengths) differ",
        "advantage epsilon: megarl (score - mean) / (std + 1e-6), TRL / (std + 1e-4) (hard-coded); both unbiased std",
        f"dual-clip: megarl's vanilla loss also bounds negative-advantage tokens at clip_ratio_c={a.clip_ratio_c}; "
        "TRL has none (acts only where the ratio exceeds it, never in a single on-policy update)",
        "reward: the same function (megarl's RewardRouter); megarl scores in reward.num_workers="
        f"{cfg.reward.num_workers} worker processes with a timeout (their memory counts in its peak), TRL inline",
        "host memory: megarl's trainer keeps freed large blocks in its heap (megarl.distributed."
        "reuse_freed_host_memory, on by default on CPU); TRL runs with glibc's malloc as users get it, unless "
        "--trl-host-malloc megarl gives it the same setting",
        "process layout: megarl = launcher + trainer rank(s) + a vLLM engine process (+ reward workers); TRL = one "
        "process; megarl also syncs weights into its engine every step (timing/sync_s)",
        "TRL shuffles the sequences of a generation batch before cutting micro-batches; megarl keeps their order "
        f"(actor.shuffle={a.shuffle})",
    ]
    if cfg.model.share_prefixes:
        notes.append("shared prompts: megarl computes the prompt a group's n samples share once per micro-batch in "
                     "its forward and backward (model.share_prefixes, the same math: see docs/long-sequences.md); "
                     "TRL computes every row whole")
    if cfg.kl_loss_active:
        notes.append("KL k3: megarl's low_var_kl clamps the per-token value at 10, TRL does not")
    if a.use_dynamic_bsz:
        notes.append("micro-batches: megarl packs real tokens up to ppo_max_token_len_per_gpu="
                     f"{a.ppo_max_token_len_per_gpu} (use_dynamic_bsz); TRL's fixed micro-batch of "
                     f"{dynamic_micro_batch(cfg)} padded rows is what that budget holds at the longest lengths")
    else:
        notes.append("micro-batches: TRL pads each micro-batch to its longest row; megarl packs rows")
    if updates_per_step(cfg) > 1:
        if a.loss_agg_mode == "token-mean":
            notes.append("token-mean with several mini-batches: megarl divides each mini-batch's loss by its own "
                         "token count, TRL's dapo by the batch's tokens / number of mini-batches")
    if cfg.data.truncation in ("left", "right"):
        notes.append(f"data.truncation={cfg.data.truncation}: megarl cuts long prompts to rollout.prompt_length; "
                     "TRL 1.16 has no prompt limit and sees them whole")
    if r.val_kwargs.do_sample or r.val_kwargs.temperature:
        notes.append("validation: both final models are scored greedily here; the recipe's val_kwargs sample")
    return notes


def update_flops(params: int, trained_tokens: float, ppo_epochs: int, forward_passes: int) -> dict[str, float]:
    """FLOPs of one RL step's update (FLOP_FORMULA): train = 6*P*T*epochs, forward_only = 2*P*T*F, total."""
    train = 6.0 * params * trained_tokens * ppo_epochs
    forward_only = 2.0 * params * trained_tokens * forward_passes
    return {"train": train, "forward_only": forward_only, "total": train + forward_only}


def forward_only_passes(cfg) -> int:
    return int(separate_old_logprob_pass(cfg)) + int(cfg.kl_loss_active)


def matmul_gflops(n: int, seconds: float) -> float:
    """GFLOP/s of one n x n @ n x n matmul that took `seconds`: 2 n^3 / t."""
    return 2.0 * n ** 3 / seconds / 1e9


def after_first(values: Sequence[float]) -> list[float]:
    """The steps a median is taken over: all but the first (start-up), or the only one of a 1-step run."""
    return list(values[1:]) if len(values) > 1 else list(values)


def step_times(ends: Sequence[float], start: Optional[float] = None, first: Optional[float] = None) -> list[float]:
    """Seconds per step from the times steps ended; the first from `start`, or given as `first`."""
    out = [first if first is not None else ends[0] - start] if ends else []
    out += [b - a for a, b in zip(ends, ends[1:])]
    return out


def summarize_steps(steps: Sequence[dict], tokens_per_step: Sequence[float]) -> dict[str, float]:
    """Medians over the steps after the first of each numeric key of `steps`; s_per_1k_tokens from `seconds` and
    the step's generated tokens."""
    kept = after_first(list(range(len(steps))))
    out: dict[str, float] = {}
    for key in sorted({k for s in steps for k in s}):
        vals = [steps[i][key] for i in kept if isinstance(steps[i].get(key), (int, float))]
        if vals:
            out[key] = median(vals)
    per_k = [steps[i]["seconds"] / tokens_per_step[i] * 1000 for i in kept if tokens_per_step[i]]
    if per_k:
        out["s_per_1k_tokens"] = median(per_k)
    out["steps_in_median"] = len(kept)
    return out


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _acc(res: dict) -> str:
    before, after = res.get("val_before"), res.get("val_after")
    return f"{_fmt(before, '.3f')} -> {_fmt(after, '.3f')}"


ROW_KEYS = (("s/step", "seconds", ".2f"), ("s/1k tok", "s_per_1k_tokens", ".2f"),
            ("peak RSS sum GiB", "peak_rss_gib", ".2f"),
            ("peak PSS GiB", "peak_pss_gib", ".2f"), ("upd GFLOP/s", "update_gflops", ".2f"),
            ("of matmul", "update_of_matmul", ".1%"))


def side_row(side: str, seed: Any, res: dict) -> list[str]:
    return [side, str(seed)] + [_fmt(res.get(key), spec) for _, key, spec in ROW_KEYS] + [_acc(res)]


def ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def format_table(results: dict[str, dict[Any, dict]]) -> str:
    """results: {side: {seed: {seconds, s_per_1k_tokens, peak_rss_gib, ..., val_before, val_after}}} -> the table:
    a row per side and seed, the medians over seeds, and megarl / TRL where both sides ran."""
    header = ["side", "seed"] + [name for name, _, _ in ROW_KEYS] + ["val acc before -> after"]
    rows = [side_row(side, seed, res) for side in ("megarl", "trl") for seed, res in results.get(side, {}).items()]
    medians = {}
    for side in ("megarl", "trl"):
        runs = list(results.get(side, {}).values())
        if runs:
            med = {}
            for key in [k for _, k, _ in ROW_KEYS] + ["val_before", "val_after"]:
                vals = [r[key] for r in runs if r.get(key) is not None]
                med[key] = median(vals) if vals else None
            medians[side] = med
            rows.append(side_row(side, "median", med))
    if len(medians) == 2:
        m, t = medians["megarl"], medians["trl"]
        rows.append(["megarl/TRL", ""] + [_fmt(ratio(m.get(k), t.get(k)), ".2f") for _, k, _ in ROW_KEYS]
                    + [f"{_fmt(m['val_after'], '.3f')} vs {_fmt(t['val_after'], '.3f')}"])
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
    lines = ["  ".join(c.rjust(w) if i > 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header] + rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def bf16_decision(requested: bool, cpu_flags: set, megarl_refusal: Optional[str]) -> tuple[bool, str]:
    """(use bf16, why). bf16 only where asked for, where the CPU computes it natively, and where megarl's validate
    accepts BF16_OVERRIDES for the recipe (megarl_refusal: its message, None when accepted)."""
    if not requested:
        return False, "float32 on both sides (--bf16 not given)"
    native = [f for f in NATIVE_BF16_FLAGS if f in cpu_flags]
    if not native:
        return False, f"--bf16 given but this CPU has none of {', '.join(NATIVE_BF16_FLAGS)}: float32 on both sides"
    if megarl_refusal is not None:
        return False, (f"--bf16 given and the CPU has {', '.join(native)}, but megarl refuses "
                       f"{' '.join(BF16_OVERRIDES)} for this recipe ({megarl_refusal}): float32 on both sides")
    return True, (f"bfloat16 ({', '.join(native)}): megarl {' '.join(BF16_OVERRIDES)} (bf16 parameters, fp32 main "
                  "params in the optimizer), TRL bf16=True (autocast over float32 weights)")


# ---------------------------------------------------------------------------------------------------------------------
# Measuring: matmul rate, process-tree memory, the two sides, the scorer
# ---------------------------------------------------------------------------------------------------------------------

def measure_matmul(n: int = 2048, repeats: int = 5) -> dict:
    """This machine's float32 matmul rate at torch's default threads: best and median of `repeats` after a warm-up."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return {"n": n, "threads": torch.get_num_threads(), "best_gflops": matmul_gflops(n, min(times)),
            "median_gflops": matmul_gflops(n, median(times))}


class TreePeak:
    """Peak memory of a process and its descendants, sampled in a thread: sum of RSS and sum of PSS."""

    def __init__(self, pid: int, interval_s: float = 0.5):
        self.pid, self.interval_s = pid, interval_s
        self.peak_rss = self.peak_pss = 0
        self.max_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root] + root.children(recursive=True)
        except psutil.Error:
            return
        rss = pss = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                try:
                    pss += p.memory_full_info().pss
                except (psutil.AccessDenied, AttributeError):
                    pass
            except psutil.Error:
                continue
        self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)
        self.max_processes = max(self.max_processes, len(procs))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        gib = 1024 ** 3
        return {"peak_rss_gib": self.peak_rss / gib, "peak_pss_gib": (self.peak_pss / gib) or None,
                "max_processes": self.max_processes}


def child_env(**extra) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.update(extra)
    return env


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def run_watched(cmd: list[str], log_path: Path, watch: Optional[Path] = None, env: Optional[dict] = None
                ) -> tuple[dict, list[float], float, float]:
    """Run cmd (output to log_path) under a TreePeak; (memory peaks, the times new lines appeared in `watch`,
    start time (monotonic), start time (wall)). Raises with the log's tail on a non-zero exit."""
    seen: list[float] = []
    with open(log_path, "w") as log:
        start, start_wall = time.monotonic(), time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or child_env(), stdout=log, stderr=subprocess.STDOUT)
        peak = TreePeak(proc.pid)
        while proc.poll() is None:
            if watch is not None and watch.exists():
                rows = watch.read_bytes().count(b"\n")
                seen.extend([time.monotonic()] * (rows - len(seen)))
            time.sleep(0.05)
        memory = peak.stop()
    if watch is not None and watch.exists():
        rows = watch.read_bytes().count(b"\n")
        seen.extend([time.monotonic()] * (rows - len(seen)))
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); {log_path}:\n{_tail(log_path)}")
    return memory, seen, start, start_wall


def megarl_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("megarl")
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "megarl.cli"]


def load_cfg(recipe: str, overrides: Sequence[str], steps: Optional[int] = None, seed: Optional[int] = None):
    from megarl.validate import load_config

    extra = ([f"trainer.total_steps={steps}"] if steps else []) + ([f"trainer.seed={seed}"] if seed is not None else [])
    return load_config(recipe, [*overrides, *extra])


def prompt_batches(cfg, tokenizer, steps: int) -> list[list]:
    """The PromptRecords of each of `steps` RL steps, as megarl's loader draws them (trainer.mode=sync)."""
    from megarl.data import PromptLoader
    from megarl.trainer import load_data

    loader = PromptLoader(load_data(cfg, tokenizer, "train"), seed=cfg.trainer.seed, shuffle=cfg.data.shuffle,
                          drop_last=cfg.data.drop_last)
    return [loader.next_batch(cfg.data.train_batch_size) for _ in range(steps)]


def param_count(model_dir: str) -> int:
    """Parameters of a safetensors model directory (each stored tensor once: tied embeddings count once)."""
    from safetensors import safe_open

    total = 0
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                count = 1
                for d in shape:
                    count *= d
                total += count
    return total


def run_megarl(ns, seed: int, run_dir: Path) -> dict:
    """`megarl train` for ns.steps steps, then `megarl merge` of its last checkpoint into run_dir/hf_final."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    val = [] if ns.megarl_own_val else ["trainer.test_freq=0", "trainer.val_before_train=false"]
    cmd = [*megarl_cmd(), "train", ns.recipe, *ns.overrides, *val, f"trainer.run_dir={run_dir}",
           f"trainer.seed={seed}", f"trainer.total_steps={ns.steps}"]
    metrics_path = run_dir / "metrics.jsonl"
    memory, seen, start, _ = run_watched(cmd, run_dir / "train.log", watch=metrics_path)
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    indexed = [(t, r) for t, r in zip(seen, rows) if r.get("step", 0) >= 1]
    ends, rows = [t for t, _ in indexed], [r for _, r in indexed]
    walls = step_times(ends, first=rows[0].get("timing/step_s") if rows else None)
    steps = []
    for wall, row in zip(walls, rows):
        step = {k: v for k, v in row.items() if k.startswith("timing/") and isinstance(v, (int, float))}
        # with in-run validation a row appears after it: then the step's own timer, else the wall between rows
        step["seconds"] = row.get("timing/step_s", wall) if ns.megarl_own_val else wall
        step["update_s"] = sum(row.get(f"timing/{p}_s", 0.0) for p in ("train", "old_log_prob", "ref"))
        step["response_length_mean"] = row.get("train/response_length_mean")
        step["pack_tokens"] = row.get("actor/pack_tokens")  # tokens computed per optimizer step (shared prompts once)
        steps.append(step)
    out = {"memory": memory, "steps": steps, "rows": len(rows), "launch_to_first_step_end_s":
           (ends[0] - start) if ends else None, "log": str(run_dir / "train.log")}
    if ns.megarl_own_val:
        val_keys = [k for k in (rows[-1] if rows else {}) if k.startswith("val/") and k.endswith("reward_mean")]
        out["own_val_last_step"] = {k: rows[-1][k] for k in val_keys}
    t0 = time.monotonic()
    merged = run_dir / "hf_final"
    with open(run_dir / "merge.log", "w") as log:
        subprocess.run([*megarl_cmd(), "merge", "--ckpt", str(run_dir), "--out", str(merged), "--no-progress"],
                       cwd=ROOT, env=child_env(), check=True, stdout=log, stderr=subprocess.STDOUT)
    out["merge_s"] = time.monotonic() - t0
    out["final_model"] = str(merged)
    if not ns.keep_checkpoints:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return out


def run_trl(ns, seed: int, run_dir: Path) -> dict:
    """This file's --trl-runner in a child process (peak memory of its own), on CPU."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    cmd = [ns.trl_python, str(Path(__file__).resolve()), "--trl-runner", "--recipe", ns.recipe, "--seed", str(seed),
           "--steps", str(ns.steps), "--run-dir", str(run_dir), "--trl-host-malloc", ns.trl_host_malloc,
           *ns.overrides]
    memory, _, _, start_wall = run_watched(cmd, run_dir / "train.log", env=child_env(CUDA_VISIBLE_DEVICES=""))
    report = json.loads((run_dir / "trl_steps.json").read_text())
    ends = [s["end"] for s in report["steps"]]
    walls = step_times(ends, start=report["train_begin"])
    steps = []
    for wall, s in zip(walls, report["steps"]):
        steps.append({"seconds": wall, "generate_s": s["generate_s"], "reward_s": s["reward_s"],
                      "update_s": wall - s["generate_s"] - s["reward_s"],
                      "response_length_mean": s["generated_tokens"] / max(1, s["samples"])})
    return {"memory": memory, "steps": steps, "final_model": str(run_dir / "hf_final"),
            "log": str(run_dir / "train.log"),
            "prompt_ids_match_megarl": report.get("prompt_ids_match_megarl"), "grpo_config": report.get("grpo_config"),
            "launch_to_first_step_end_s": report["steps"][0]["end_wall"] - start_wall if report["steps"] else None}


def score(ns, model_dir: str, out_json: Path) -> dict:
    """--score-model in a child process: greedy validation accuracy of model_dir."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--score-model", model_dir, "--recipe", ns.recipe,
           "--score-out", str(out_json), "--val-limit", str(ns.val_limit), "--score-batch", str(ns.score_batch),
           *ns.overrides]
    with open(out_json.with_suffix(".log"), "w") as log:
        subprocess.run(cmd, cwd=ROOT, env=child_env(CUDA_VISIBLE_DEVICES=""), check=True, stdout=log,
                       stderr=subprocess.STDOUT)
    return json.loads(out_json.read_text())


def finish_side(cfg, res: dict, params: int, prompt_tokens: list[int], matmul: dict) -> dict:
    """Medians and the update's FLOP/s of one side's run."""
    b_n = cfg.data.train_batch_size * cfg.rollout.n
    gen_tokens = [(s.get("response_length_mean") or 0.0) * b_n for s in res["steps"]]
    summary = summarize_steps(res["steps"], gen_tokens)
    flops = []
    for s, gen, prompt in zip(res["steps"], gen_tokens, prompt_tokens):
        f = update_flops(params, prompt + gen, cfg.actor.ppo_epochs, forward_only_passes(cfg))
        flops.append(f["total"] / s["update_s"] if s.get("update_s") else None)
    kept = [f for f in after_first(flops) if f]
    summary["update_gflops"] = median(kept) / 1e9 if kept else None
    summary["update_of_matmul"] = (summary["update_gflops"] / matmul["best_gflops"]
                                   if summary["update_gflops"] else None)
    # megarl computes a group's shared prompt once (model.share_prefixes): the FLOP/s of the tokens it computed
    opt_steps = cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size
    shares, rates = [], []
    for s, gen, prompt in zip(res["steps"], gen_tokens, prompt_tokens):
        if s.get("pack_tokens") and s.get("update_s"):
            t = s["pack_tokens"] * opt_steps
            shares.append(t / (prompt + gen))
            rates.append(update_flops(params, t, cfg.actor.ppo_epochs, forward_only_passes(cfg))["total"]
                         / s["update_s"])
    if rates:
        summary["computed_token_share"] = median(after_first(shares))
        summary["computed_gflops"] = median(after_first(rates)) / 1e9
        summary["computed_of_matmul"] = summary["computed_gflops"] / matmul["best_gflops"]
    summary.update(res["memory"])
    summary["generated_tokens_per_step"] = median(after_first(gen_tokens)) if gen_tokens else None
    return summary


def bench(ns) -> int:
    from transformers import AutoTokenizer

    out = Path(ns.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    flags = set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()
    refusal = None
    if ns.bf16 and any(f in flags for f in NATIVE_BF16_FLAGS):
        try:
            load_cfg(ns.recipe, [*ns.overrides, *BF16_OVERRIDES], ns.steps)
        except Exception as exc:  # megarl's ConfigError names the key and the rule
            refusal = " ".join(str(exc).split())[:300]
    use_bf16, bf16_why = bf16_decision(ns.bf16, flags, refusal)
    if use_bf16:
        ns.overrides = [*ns.overrides, *BF16_OVERRIDES]  # both sides: the TRL runner maps model.dtype to bf16
    cfg = load_cfg(ns.recipe, ns.overrides, ns.steps)
    ns.steps = ns.steps or cfg.trainer.total_steps
    kwargs = grpo_config_kwargs(cfg, str(out / "trl"), ns.steps, cfg.trainer.seed)  # refuses before any compute
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    params = param_count(cfg.model.path)
    notes = unequal_notes(cfg)
    table = settings_table(cfg, kwargs)
    print(f"bench_trl: {ns.recipe}, {ns.steps} steps, seeds {ns.seeds}, sides {ns.side}; {params / 1e6:.1f}M "
          f"parameters; {bf16_why}", flush=True)
    print("TRL GRPOConfig <- megarl recipe:")
    for name, value, source in table:
        print(f"  {name:<46} {str(value):<28} <- {source}")
    print("not equal between the sides:")
    for note in notes:
        print(f"  - {note}")
    matmul_before = measure_matmul()
    print(f"float32 matmul 2048^3 at {matmul_before['threads']} threads: {matmul_before['best_gflops']:.1f} GFLOP/s "
          f"(best of 5)", flush=True)

    before = score(ns, cfg.model.path, out / "score_initial.json")
    print(f"initial model, greedy validation accuracy {before['accuracy']:.3f} on {before['prompts']} prompts",
          flush=True)
    results: dict[str, dict] = {"megarl": {}, "trl": {}}
    raw: dict[str, dict] = {"megarl": {}, "trl": {}}
    sides = ["megarl", "trl"] if ns.side == "both" else [ns.side]
    for i, seed in enumerate(ns.seeds):
        seed_cfg = load_cfg(ns.recipe, ns.overrides, ns.steps, seed)
        batches = prompt_batches(seed_cfg, tokenizer, ns.steps)
        prompt_tokens = [sum(len(r.prompt_ids) for r in batch) * seed_cfg.rollout.n for batch in batches]
        for side in (sides if i % 2 == 0 else sides[::-1]):  # alternate which side goes first
            print(f"bench_trl: {side}, seed {seed}, {ns.steps} steps ...", flush=True)
            run_dir = out / f"{side}_seed{seed}"
            res = run_megarl(ns, seed, run_dir) if side == "megarl" else run_trl(ns, seed, run_dir)
            summary = finish_side(seed_cfg, res, params, prompt_tokens, matmul_before)
            after = score(ns, res["final_model"], run_dir / "score_final.json")
            summary.update(val_before=before["accuracy"], val_after=after["accuracy"],
                           val_after_by_file=after["by_file"], launch_to_first_step_end_s=res.get(
                               "launch_to_first_step_end_s"))
            if "own_val_last_step" in res:
                summary["megarl_own_val_last_step"] = res["own_val_last_step"]
            results[side][seed] = summary
            raw[side][seed] = res
            print(f"  {side} seed {seed}: {_fmt(summary.get('seconds'), '.2f')} s/step, peak RSS "
                  f"{summary['peak_rss_gib']:.2f} GiB, val {before['accuracy']:.3f} -> {after['accuracy']:.3f}",
                  flush=True)
    matmul_after = measure_matmul()

    print(f"\nseconds per RL step: median over steps 2..{ns.steps} (the only step when --steps 1); wall time between "
          "step ends (megarl: metrics.jsonl rows; TRL: the RL step's last optimizer step)")
    print(format_table(results))
    phases = sorted({k for s in results["megarl"].values() for k in s if k.startswith("timing/")})
    if phases:
        print("\nmegarl phases (median s over steps after the first):")
        for seed, s in results["megarl"].items():
            print(f"  seed {seed}: " + ", ".join(f"{k[7:-2]} {s[k]:.3f}" for k in phases if k in s))
    for seed, s in results["megarl"].items():
        if s.get("computed_token_share") is not None:
            print(f"  seed {seed}: computes {s['computed_token_share']:.1%} of the prompt + response tokens (shared "
                  f"prompts once), at {s['computed_gflops']:.1f} GFLOP/s ({s['computed_of_matmul']:.1%} of matmul)")
    for seed, s in results["trl"].items():
        print(f"TRL seed {seed}: generate {s.get('generate_s', 0):.3f} s, reward {s.get('reward_s', 0):.3f} s, "
              f"update (the rest) {s.get('update_s', 0):.3f} s")
    print(f"\nFLOPs: {FLOP_FORMULA}; P = {params}; matmul {matmul_before['best_gflops']:.1f} GFLOP/s before, "
          f"{matmul_after['best_gflops']:.1f} after")
    print("memory: peaks of the side's process tree sampled every 0.5 s; the RSS sum counts every page shared "
          "between processes (torch's libraries, shared memory) once per process, so for megarl's several "
          "processes PSS (shared pages split between their users) is the comparable figure")
    for seed, res in raw["trl"].items():
        print(f"TRL seed {seed}: prompt token ids equal to megarl's (first prompt): "
              f"{res.get('prompt_ids_match_megarl')}")
    print("val accuracy: greedy HF generate of each final model (megarl: merged from its last checkpoint) on the "
          f"recipe's val files ({before['prompts']} prompts), scored by megarl's reward code; the same scorer for both")
    report = {"recipe": ns.recipe, "overrides": ns.overrides, "steps": ns.steps, "seeds": ns.seeds,
              "trl_version": TRL_VERSION, "trl_host_malloc": ns.trl_host_malloc, "parameters": params, "bf16": {"used": use_bf16, "why": bf16_why},
              "flop_formula": FLOP_FORMULA, "matmul_before": matmul_before, "matmul_after": matmul_after,
              "settings": [{"trl": n, "value": str(v), "megarl": s} for n, v, s in table],
              "grpo_config_kwargs": kwargs, "unequal": notes, "val_initial": before,
              "results": {side: {str(k): v for k, v in r.items()} for side, r in results.items()},
              "runs": {side: {str(k): v for k, v in r.items()} for side, r in raw.items()}}
    (out / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwritten: {out / 'results.json'}")
    return 0


# ---------------------------------------------------------------------------------------------------------------------
# Child processes: the TRL runner and the scorer
# ---------------------------------------------------------------------------------------------------------------------

def trl_runner(ns) -> int:
    """GRPOTrainer on the recipe's prompts (megarl's order), megarl's reward; writes trl_steps.json and hf_final/."""
    import torch
    import transformers
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarl.algo import overlong_reward_penalty
    from megarl.reward.compute import RewardInput, compute_rewards
    from megarl.reward.registry import reward_fn_from_config

    transformers.logging.set_verbosity_warning()
    if ns.trl_host_malloc == "megarl":
        from megarl.distributed import reuse_freed_host_memory

        print(f"host malloc: megarl's reuse_freed_host_memory -> {reuse_freed_host_memory()}", flush=True)
    run_dir = Path(ns.run_dir)
    cfg = load_cfg(ns.recipe, ns.overrides, ns.steps, ns.seed)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    batches = prompt_batches(cfg, tokenizer, ns.steps)
    records = {rec.index: rec for batch in batches for rec in batch}
    rows = [{"prompt": [dict(m) for m in rec.prompt], "megarl_index": rec.index} for batch in batches for rec in batch]
    # TRL renders conversational prompts with apply_chat_template(add_generation_prompt=True): check the ids are
    # megarl's
    first = batches[0][0]
    trl_ids = tokenizer.apply_chat_template([dict(m) for m in first.prompt], add_generation_prompt=True,
                                            tokenize=True, return_dict=True)["input_ids"]
    ids_match = list(trl_ids) == list(first.prompt_ids)
    kwargs = grpo_config_kwargs(cfg, str(run_dir / "trl_out"), ns.steps, ns.seed)
    args = GRPOConfig(**kwargs)
    reward_fn = reward_fn_from_config(cfg.reward)
    clock = {"generate_s": 0.0, "reward_s": 0.0, "generated_tokens": 0, "samples": 0}

    def megarl_reward(prompts, completions, completion_ids, megarl_index, **_):
        samples = []
        for text, idx in zip(completions, megarl_index):
            rec = records[int(idx)]
            text = text[0]["content"] if isinstance(text, list) else text
            samples.append(RewardInput(rec.data_source, text, rec.ground_truth, rec.extra_info, rec.uid))
        scores, _, _ = compute_rewards(reward_fn, samples, cfg.reward.timeout_s, 0, cfg.reward.reward_kwargs)
        ob = cfg.reward.overlong_buffer
        if ob.enable:  # megarl adds DAPO's overlong penalty to the rule's score (steps.score): the same function
            penalty, _ = overlong_reward_penalty(torch.tensor([len(c) for c in completion_ids]),
                                                 cfg.rollout.response_length, ob.len, ob.penalty_factor)
            scores = [float(s) + float(p) for s, p in zip(scores, penalty)]
        clock["generated_tokens"] += sum(len(c) for c in completion_ids)
        clock["samples"] += len(completion_ids)
        return scores

    megarl_reward.__name__ = "megarl_reward"

    class Timed(GRPOTrainer):
        def _generate(self, *a, **k):
            t0 = time.monotonic()
            try:
                return super()._generate(*a, **k)
            finally:
                clock["generate_s"] += time.monotonic() - t0

        def _calculate_rewards(self, *a, **k):
            t0 = time.monotonic()
            try:
                return super()._calculate_rewards(*a, **k)
            finally:
                clock["reward_s"] += time.monotonic() - t0

    per_rl = updates_per_step(cfg)
    report: dict[str, Any] = {"steps": [], "prompt_ids_match_megarl": ids_match,
                              "grpo_config": {k: getattr(args, k) for k in kwargs if k != "output_dir"}}

    class StepClock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            report["train_begin"] = time.monotonic()

        def on_step_end(self, _args, state, control, **k):
            if state.global_step % per_rl == 0:
                report["steps"].append({"step": state.global_step // per_rl, "end": time.monotonic(),
                                        "end_wall": time.time(), **clock})
                clock.update(generate_s=0.0, reward_s=0.0, generated_tokens=0, samples=0)

    torch.manual_seed(ns.seed)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=torch.float32)
    trainer = Timed(model=model, reward_funcs=[megarl_reward], args=args, train_dataset=Dataset.from_list(rows),
                    processing_class=tokenizer, callbacks=[StepClock()])
    trainer.train()
    (run_dir / "trl_steps.json").write_text(json.dumps(report, indent=1, default=str))
    trainer.save_model(str(run_dir / "hf_final"))
    tokenizer.save_pretrained(str(run_dir / "hf_final"))
    return 0


def score_model(ns) -> int:
    """Greedy accuracy of ns.score_model on the recipe's val prompts (megarl's encoding, first --val-limit of each
    file), HF generate at rollout.response_length, scored by megarl's reward code (num_workers=0)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megarl.reward.compute import RewardInput, compute_rewards
    from megarl.reward.registry import reward_fn_from_config
    from megarl.trainer import load_data

    cfg = load_cfg(ns.recipe, ns.overrides)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer_path or cfg.model.path)
    records = load_data(cfg, tokenizer, "val")
    if ns.val_limit:
        per_file: dict[str, int] = {}
        kept = []
        for rec in records:
            f = rec.uid.rsplit("#", 1)[0]
            if per_file.get(f, 0) < ns.val_limit:
                kept.append(rec)
                per_file[f] = per_file.get(f, 0) + 1
        records = kept
    model = AutoModelForCausalLM.from_pretrained(ns.score_model, dtype=torch.float32).eval()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = {tokenizer.eos_token_id}
    gen_eos = model.generation_config.eos_token_id
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    texts = []
    for i in range(0, len(records), ns.score_batch):
        chunk = records[i:i + ns.score_batch]
        width = max(len(r.prompt_ids) for r in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(chunk):
            ids[j, width - len(r.prompt_ids):] = torch.tensor(r.prompt_ids)
            mask[j, width - len(r.prompt_ids):] = 1
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=
                                 cfg.rollout.response_length, pad_token_id=pad, eos_token_id=sorted(eos),
                                 temperature=None, top_p=None, top_k=None)
        for row in out[:, width:].tolist():
            cut = next((k + 1 for k, t in enumerate(row) if t in eos), len(row))
            texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    samples = [RewardInput(r.data_source, t, r.ground_truth, r.extra_info, r.uid) for r, t in zip(records, texts)]
    scores, _, _ = compute_rewards(reward_fn_from_config(cfg.reward), samples, cfg.reward.timeout_s, 0,
                                   cfg.reward.reward_kwargs)
    by_file: dict[str, list[float]] = {}
    for r, s in zip(records, scores):
        by_file.setdefault(r.uid.rsplit("#", 1)[0], []).append(float(s == 1.0))
    result = {"model": ns.score_model, "prompts": len(records),
              "accuracy": sum(float(s == 1.0) for s in scores) / max(1, len(scores)),
              "reward_mean": sum(scores) / max(1, len(scores)),
              "by_file": {f: sum(v) / len(v) for f, v in by_file.items()},
              "first_response": texts[0] if texts else None}
    Path(ns.score_out).write_text(json.dumps(result, indent=1))
    return 0


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default=str(DEFAULT_RECIPE.relative_to(ROOT)),
                    help="megarl recipe (default: %(default)s)")
    ap.add_argument("--steps", type=int, help="RL steps on both sides (default: the recipe's trainer.total_steps)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="trainer.seed / GRPOConfig.seed per run")
    ap.add_argument("--side", choices=("megarl", "trl", "both"), default="both")
    ap.add_argument("--out", default="runs/bench_trl", help="run directories and results.json")
    ap.add_argument("--val-limit", type=int, default=0, help="score only the first K prompts of each val file (0: all)")
    ap.add_argument("--score-batch", type=int, default=16, help="prompts per greedy generate call when scoring")
    ap.add_argument("--bf16", action="store_true", help="bfloat16 on both sides where the CPU has native bf16 and "
                    "megarl validates model.dtype=bfloat16 for the recipe (the output says which, and why)")
    ap.add_argument("--megarl-own-val", action="store_true", help="keep the recipe's in-run validation on the megarl "
                    "side (its val/reward_mean at the last step is reported too; step time then from timing/step_s)")
    ap.add_argument("--keep-checkpoints", action="store_true", help="keep megarl's checkpoints after the merge")
    ap.add_argument("--trl-host-malloc", choices=("default", "megarl"), default="default",
                    help="TRL's process with glibc's malloc as it is (default) or with megarl's "
                         "reuse_freed_host_memory (megarl: the same host-memory setting on both sides)")
    ap.add_argument("--trl-python", default=sys.executable, help="Python that has trl (default: this one)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides for both sides (section.key=value), anywhere on "
                    "the line")
    # child-process modes
    ap.add_argument("--trl-runner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", help=argparse.SUPPRESS)
    ap.add_argument("--score-model", help=argparse.SUPPRESS)
    ap.add_argument("--score-out", help=argparse.SUPPRESS)
    argv = list(sys.argv[1:] if argv is None else argv)
    # section.key=value anywhere (also after --seeds 1 2 3, which would otherwise take them as seeds)
    overrides = [a for a in argv if "=" in a and not a.startswith("-")]
    ns = ap.parse_args([a for a in argv if a not in overrides])
    ns.overrides = overrides
    return ns


def main(argv=None) -> int:
    ns = parse_args(argv)
    if ns.trl_runner:
        return trl_runner(ns)
    if ns.score_model:
        return score_model(ns)
    return bench(ns)


if __name__ == "__main__":
    sys.exit(main())
