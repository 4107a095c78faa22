"""The models of an RL run as batch-level operations: actor / reference (policy) and critic.

Each worker holds this rank's shard of one megatron model. Methods take the whole step's batch (every rank holds it,
see megarl.runtime) and return whole-batch results on every rank; internally each DP rank computes its rows.
"""
from __future__ import annotations

from statistics import fmean
from typing import Iterator, Optional

import torch

from megarl.batching import mini_batch_rows, select_rows, split_by_token_budget, split_micro
from megarl.config import MegarlConfig
from megarl.config.schema import OptimConfig
from megarl.megatron.forward import token_logprobs, token_logprobs_and_sum_pi_squared, token_values
from megarl.megatron.losses import PolicyLossSettings, make_policy_loss_fn, make_value_loss_fn
from megarl.megatron.model import build_and_load
from megarl.megatron.train_step import Trainable, loss_denominator, make_trainable, train_mini_batch
from megarl.runtime import Runtime, dp_row_range, gather_model_output


def recompute_overrides(recompute: str) -> dict:
    """TransformerConfig fields for model.recompute: selective recomputes the attention core, full whole layers."""
    if recompute == "selective":
        return {"recompute_granularity": "selective"}
    if recompute == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    return {}


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_options(cfg: MegarlConfig) -> dict:
    """build_and_load keywords from model.* and parallelism.*: None leaves megarl's defaults (float32 on CPU and
    bfloat16 on GPU; Transformer Engine when CUDA and TE are available; sequence parallelism for MoE with TP > 1)."""
    m, p = cfg.model, cfg.parallelism
    return {"dtype": _DTYPES.get(m.dtype),
            "use_te": None if m.use_transformer_engine == "auto" else m.use_transformer_engine,
            "sequence_parallel": p.sequence_parallel or None,
            **recompute_overrides(m.recompute)}


def _forward_rows(rt: Runtime, ids: torch.Tensor, fn, width) -> torch.Tensor:
    """fn's per-row output [rows, *width] on this rank's DP rows, gathered to [N, *width] on every rank."""
    rows = dp_row_range(ids.shape[0], rt)
    local = fn(ids[rows])
    return gather_model_output(local, (rows.stop - rows.start, *((width,) if isinstance(width, int) else width)))


def _average(metrics: list[dict]) -> dict:
    return {k: fmean(m[k] for m in metrics) for k in metrics[0]} if metrics else {}


class _Worker:
    def __init__(self, hf_dir: str, cfg: MegarlConfig, value_head: bool, optim: Optional[OptimConfig],
                 total_steps: int):
        self.model, self.spec = build_and_load(hf_dir, value_head=value_head, **build_options(cfg))
        self.trainable: Optional[Trainable] = None
        if optim is not None:
            self.trainable = make_trainable(self.model, optim, total_steps,
                                            cfg.parallelism.use_distributed_optimizer)

    @property
    def chunks(self):
        return self.trainable.chunks if self.trainable else self.model

    def _update(self, batch: dict, rt: Runtime, mini_batch_size: int, micro_batch_size: int, epochs: int,
                shuffle_seed: Optional[int], agg_mode: str, make_loss, max_tokens: Optional[int] = None) -> dict:
        """ppo_epochs passes over the batch in mini-batches; micro-batches of a fixed size, or packed up to
        `max_tokens` real tokens each (dynamic batch size)."""
        n = batch["input_ids"].shape[0]
        out = []
        for epoch in range(epochs):
            gen = torch.Generator().manual_seed(shuffle_seed + epoch) if shuffle_seed is not None else None
            for rows in mini_batch_rows(n, mini_batch_size, rt.dp_size, rt.dp_rank, gen):
                share = {**select_rows(batch, rows), "row_index": rows}
                micro = (split_by_token_budget(share, max_tokens) if max_tokens
                         else split_micro(share, micro_batch_size))
                denominator = loss_denominator([m["response_mask"] for m in micro], agg_mode)
                out.append(train_mini_batch(self.trainable, micro, make_loss(denominator)))
        return _average(out)


class PolicyWorker(_Worker):
    """The actor (trainable) or the frozen reference policy."""

    def __init__(self, hf_dir: str, cfg: MegarlConfig, trainable: bool, optim: Optional[OptimConfig] = None,
                 total_steps: Optional[int] = None, log_prob_micro_batch_size: Optional[int] = None):
        super().__init__(hf_dir, cfg, False, (optim or cfg.actor.optim) if trainable else None,
                         total_steps or cfg.trainer.total_steps)
        self.cfg = cfg
        self.log_prob_micro_batch_size = log_prob_micro_batch_size  # None: the actor's or the reference's setting
        self.loss_settings = PolicyLossSettings.from_config(cfg, self.spec.vocab_size)

    def log_probs(self, batch: dict, rt: Runtime, sum_pi_squared: bool = False):
        """Logprobs [N, T] of every token given its prefix, at the rollout temperature. sum_pi_squared: also
        sum_v pi(v)^2 [N, T] at each position (optimal_token_baseline), returned as a pair."""
        micro = self.log_prob_micro_batch_size or (
            self.cfg.rollout.log_prob_micro_batch_size_per_gpu if self.trainable is not None
            else self.cfg.ref.log_prob_micro_batch_size_per_gpu)
        t = self.loss_settings.temperature
        ids = batch["input_ids"]
        if sum_pi_squared:
            both = _forward_rows(rt, ids, lambda x: token_logprobs_and_sum_pi_squared(
                self.chunks, x, _micro(x.shape[0], micro), t), (ids.shape[1] - 1, 2))
            return both[..., 0].contiguous(), both[..., 1].contiguous()
        return _forward_rows(rt, ids, lambda x: token_logprobs(self.chunks, x, _micro(x.shape[0], micro), t),
                             ids.shape[1] - 1)

    def update(self, batch: dict, rt: Runtime, step: int, on_policy: bool = False) -> dict:
        """PPO update(s) of the actor on the step's batch; returns actor/* metrics.

        on_policy: the batch gets exactly one optimizer step (see steps.old_log_probs_from_update), so it needs no
        old_log_probs: the update's own forward gives them, and they are added to `batch` ([N, T] on every rank) for
        what reads them after the update."""
        a, n = self.cfg.actor, self.cfg.rollout.n
        num_samples = batch["input_ids"].shape[0]
        if on_policy and (a.ppo_epochs != 1 or a.ppo_mini_batch_size * n != num_samples):
            raise ValueError(f"an on-policy update needs exactly one optimizer step, but actor.ppo_epochs="
                             f"{a.ppo_epochs} and {num_samples} samples in mini-batches of {a.ppo_mini_batch_size * n}"
                             " give more; compute old_log_probs with log_probs() first")
        seed = self.cfg.trainer.seed * 100_003 + step if a.shuffle else None
        kept = [] if on_policy else None
        metrics = self._update(batch, rt, a.ppo_mini_batch_size * n, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs,
                               seed, a.loss_agg_mode,
                               lambda d: make_policy_loss_fn(self.loss_settings, d, self.cfg.rollout.response_length,
                                                             kept),
                               a.ppo_max_token_len_per_gpu if a.use_dynamic_bsz else None)
        if on_policy:
            device = next(self.chunks[0].parameters()).device
            batch["old_log_probs"] = _assemble_rows(kept, batch["response_mask"], device)
        return {f"actor/{k}": v for k, v in metrics.items()}

    def export(self, bucket_bytes: int) -> Iterator[list]:
        from megarl.bridge.exporter import export_hf_weights

        return export_hf_weights(self.chunks, self.spec, bucket_bytes)


class CriticWorker(_Worker):
    def __init__(self, hf_dir: str, cfg: MegarlConfig):
        super().__init__(hf_dir, cfg, True, cfg.critic.optim, cfg.trainer.total_steps)
        self.cfg = cfg

    def values(self, batch: dict, rt: Runtime) -> torch.Tensor:
        """V(prefix up to t) aligned with logprob positions: [N, T]."""
        micro = self.cfg.rollout.log_prob_micro_batch_size_per_gpu
        ids = batch["input_ids"]
        s = ids.shape[1]
        return _forward_rows(rt, ids, lambda x: _cut(token_values(self.chunks, x, _micro(x.shape[0], micro)), s - 1),
                             s - 1)

    def update(self, batch: dict, rt: Runtime, step: int) -> dict:
        c, n = self.cfg.critic, self.cfg.rollout.n
        metrics = self._update(batch, rt, self.cfg.actor.ppo_mini_batch_size * n, c.ppo_micro_batch_size_per_gpu,
                               c.ppo_epochs, None, c.loss_agg_mode,
                               lambda d: make_value_loss_fn(c.cliprange_value, c.loss_agg_mode, d,
                                                            self.cfg.rollout.response_length))
        return {f"critic/{k}": v for k, v in metrics.items()}


def _assemble_rows(parts: list, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole batch's [N, T] float tensor (shaped and placed like `like`) on every rank, from the
    (row_index [b], values [b, t <= T]) parts computed on this rank's last pipeline stage (none on other stages).
    `device` is the model's: the collectives run there.

    Every row comes from exactly one DP rank and is 0 on the others, so a sum over DP assembles the batch exactly."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    out = torch.zeros(like.shape, dtype=torch.float32, device=device)
    for rows, values in parts:
        out[rows.to(device), : values.shape[1]] = values.float()
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.broadcast(out, src=ps.get_pipeline_model_parallel_last_rank(),
                       group=ps.get_pipeline_model_parallel_group())
    if ps.get_data_parallel_world_size() > 1:
        dist.all_reduce(out, group=ps.get_data_parallel_group())
    return out.to(like.device)


def _cut(values: Optional[torch.Tensor], width: int) -> Optional[torch.Tensor]:
    return None if values is None else values[:, :width]


def _micro(n: int, at_most: int) -> int:
    """Forward micro-batch size for n rows: at_most, or n when fewer (run_microbatches pads the last micro-batch, so
    n need not divide by it)."""
    return max(1, min(n, at_most))
