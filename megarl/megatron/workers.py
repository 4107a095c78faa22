"""The models of an RL run as batch-level operations: actor / reference (policy) and critic.

Each worker holds this rank's shard of one megatron model. Methods take the whole step's batch (every rank holds it,
see megarl.distributed) and return whole-batch results on every rank; internally each DP rank computes its rows.
"""
from __future__ import annotations

from functools import partial
from statistics import fmean
from typing import Iterator, Optional

import torch

from megarl.batching import (agreed_budget_groups, balanced_shares, fewest_groups, forward_by_token_budget,
                             mini_batch_rows, select_rows, sequence_lengths, split_by_token_budget, split_micro)
from megarl.config import MegarlConfig
from megarl.config.schema import OptimConfig
from megarl.megatron import router_replay, shared_prefix
from megarl.megatron.forward import token_logprobs, token_logprobs_and_sum_pi_squared, token_values
from megarl.megatron.losses import PolicyLoss, PolicyLossSettings, ValueLoss
from megarl.megatron.model import build_and_load
from megarl.megatron.packing import agreed_max, expert_parallel
from megarl.megatron.train_step import Trainable, loss_denominator, make_trainable, train_mini_batch
from megarl.distributed import DataParallelRank, dp_row_range, gather_model_output


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
            # LoRA adapters sit on megatron's local linears: auto picks the local spec for a LoRA run
            "use_te": (False if cfg.actor.lora.enabled else None) if m.use_transformer_engine == "auto"
            else m.use_transformer_engine,
            "fusions": m.fusions,
            "sequence_parallel": p.sequence_parallel or None,
            **({"moe_router_dtype": m.moe_router_dtype} if m.moe_router_dtype else {}),
            # routing replay goes through megatron's unfused top-k (router.router_replay)
            **({"moe_enable_routing_replay": True, "moe_router_fusion": False}
               if cfg.actor.router_replay.mode != "none" or cfg.routes_from_engine else {}),
            **recompute_overrides(m.recompute)}


def _forward_rows(rt: DataParallelRank, ids: torch.Tensor, lengths: Optional[torch.Tensor], fn, width,
                  order: Optional[torch.Tensor] = None) -> torch.Tensor:
    """fn(ids [n, S], lengths [n] or None)'s per-row output [n, *width] on this rank's DP rows, gathered to
    [N, *width] on every rank. order [N]: the rows dealt over the DP ranks in this order (rows_over_ranks)."""
    rows = dp_row_range(ids.shape[0], rt)
    router_replay.STATE.pass_rows = _row_ids(ids.shape[0], order)[rows]  # the rows' ids, for routing replay
    ids, lengths = _ordered(ids, order), _ordered(lengths, order)
    local = fn(ids[rows], None if lengths is None else lengths[rows])
    out = gather_model_output(local, (rows.stop - rows.start, *((width,) if isinstance(width, int) else width)))
    return _restored(out, order)


def rows_over_ranks(lengths: Optional[torch.Tensor], dp: int) -> Optional[torch.Tensor]:
    """At expert parallelism, an order of the N rows whose contiguous DP shares hold near-equal tokens
    (megarl.batching.balanced_shares): the expert-parallel ranks pad their packs to each other's, so balanced shares
    leave little to pad. None otherwise (the contiguous shares)."""
    if lengths is None or dp == 1 or not expert_parallel() or len(lengths) % dp:
        return None
    return torch.tensor(balanced_shares([int(x) for x in lengths.tolist()], dp), dtype=torch.long)


def _ordered(x: Optional[torch.Tensor], order: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """x's rows in `order` (x unchanged without one)."""
    if x is None or order is None:
        return x
    return x[order.to(x.device)]


def _row_ids(n: int, order: Optional[torch.Tensor]) -> torch.Tensor:
    """The batch's row id at each position of the ordered rows."""
    return torch.arange(n) if order is None else order


def _restored(out: torch.Tensor, order: Optional[torch.Tensor]) -> torch.Tensor:
    """Outputs gathered in `order` back in the rows' own order."""
    if order is None:
        return out
    return out[order.argsort().to(out.device)]


def _forward_only(cfg: MegarlConfig, rt: DataParallelRank, batch: dict, forward, micro: int, width: int,
                  trailing: tuple = (), share: bool = False) -> torch.Tensor:
    """This rank's rows of a forward-only pass (old/reference logprobs, values), gathered on every rank: micro-batches
    of `micro` rows, or of at most rollout.log_prob_max_token_len_per_gpu tokens with rollout.log_prob_use_dynamic_bsz;
    each runs packed, each row up to its last response token (megarl.batching.sequence_lengths); share: token
    budgets keep rows with a common prefix together (megarl.megatron.shared_prefix.budget_bins). At expert
    parallelism the rows are dealt over the DP ranks by tokens (rows_over_ranks) and token budgets agree on their
    count (expert_bins).
    forward(tokens [g, s], micro_batch_size, lengths [g] or None) -> [g, <= s, *trailing]."""
    r, ids = cfg.rollout, batch["input_ids"]
    all_lengths = sequence_lengths(batch).clamp(1, ids.shape[1]) if "response_mask" in batch else None
    order = rows_over_ranks(all_lengths, rt.dp_size)
    if r.log_prob_use_dynamic_bsz and all_lengths is not None:
        rows = dp_row_range(ids.shape[0], rt)
        row_ids = _row_ids(ids.shape[0], order)
        ids, all_lengths = _ordered(ids, order), _ordered(all_lengths, order)
        lengths = all_lengths[rows]

        def on_rows(idx):  # the global ids of each token-budget group, for routing replay
            router_replay.STATE.pass_rows = row_ids[idx + rows.start]

        budget = per_micro_batch(cfg, r.log_prob_max_token_len_per_gpu)
        bins = expert_bins([int(x) for x in lengths.tolist()], budget)  # at expert parallelism: an agreed count
        if bins is None and share:
            bins = shared_prefix.budget_bins(ids[rows], lengths, budget)
        local = forward_by_token_budget(forward, ids[rows], lengths, budget, width, on_rows=on_rows, bins=bins)
        return _restored(gather_model_output(local, (rows.stop - rows.start, width, *trailing)), order)
    return _forward_rows(rt, ids, all_lengths, lambda x, lens: forward(x, _micro(x.shape[0], micro), lens),
                         (width, *trailing), order)


def images_of(batch: dict):
    """For a forward-only pass over `batch`: a callable giving the images of the rows being forwarded now (the rows
    _forward_rows and the token-budget groups name before each call, router_replay.STATE.pass_rows), or None when
    the batch has no images (megarl.batching.VISION_KEYS)."""
    from megarl.batching import VISION_KEYS

    if VISION_KEYS[1] not in batch:
        return lambda: None

    def now():
        rows = router_replay.STATE.pass_rows
        return {k: batch[k][rows] for k in VISION_KEYS}

    return now


def expert_bins(lengths: list[int], budget: int) -> Optional[list[list[int]]]:
    """Token-budget micro-batches at expert parallelism: as many on every rank of the expert-parallel group, their
    tokens balanced and dealt heaviest first, so the sizes the group agrees on per micro-batch
    (megarl.megatron.packing.agreed_sizes) need little end padding (megarl.batching.agreed_budget_groups). None
    without expert parallelism (first-fit decreasing per rank)."""
    if not expert_parallel():
        return None
    return agreed_budget_groups(lengths, budget, agreed_max)


def _idle_micro_batch(share: dict) -> dict:
    """A micro-batch for a rank with fewer rows than the micro-batch count its expert-parallel group agreed on: its
    first row with no response token, so it joins the peers' token dispatch and adds nothing to the loss or the
    gradient (the loss reads response tokens only)."""
    one = {k: v[:1].clone() for k, v in share.items()}
    one["response_mask"] = torch.zeros_like(one["response_mask"])
    return one


def per_micro_batch(cfg: MegarlConfig, tokens_per_gpu: int) -> int:
    """A micro-batch's token budget from a per-GPU one: under context parallelism each rank computes 1 / CP of a
    micro-batch's tokens, so it holds CP times the per-GPU budget (verl's rule for its *_max_token_len_per_gpu)."""
    return tokens_per_gpu * cfg.parallelism.context_parallel_size


def _average(metrics: list[dict]) -> dict:
    return {k: fmean(m[k] for m in metrics) for k in metrics[0]} if metrics else {}


def lora_settings(cfg: MegarlConfig):
    """megarl.lora's settings for actor.lora (None when rank is 0)."""
    from megarl.lora import LoraSettings

    lo = cfg.actor.lora
    if not lo.enabled:
        return None
    targets = lo.target_modules if isinstance(lo.target_modules, str) else tuple(lo.target_modules)
    return LoraSettings(rank=lo.rank, alpha=lo.alpha, dropout=lo.dropout, target_modules=targets, init=lo.init,
                        seed=cfg.trainer.seed)


class _Worker:
    def __init__(self, hf_dir: str, cfg: MegarlConfig, value_head: bool, optim: Optional[OptimConfig],
                 total_steps: int, lora=None):
        self.model, self.spec = build_and_load(hf_dir, value_head=value_head, **build_options(cfg))
        shared_prefix.enable(self.model, cfg.model.share_prefixes)  # off for vision-language models (supported)
        self.replay_metrics: dict = {}  # router_replay/* of this worker's last passes
        if (cfg.actor.router_replay.mode != "none" or cfg.routes_from_engine) and not value_head and self.spec.is_moe:
            router_replay.install(self.model if isinstance(self.model, (list, tuple)) else [self.model])
        self.lora = lora
        if lora is not None:  # frozen base + adapters, before DDP: the base gets no gradient buffer or optimizer state
            from megarl.lora.layers import apply_lora

            apply_lora(self.model, self.spec, lora)
        self.trainable: Optional[Trainable] = None
        if optim is not None:
            self.trainable = make_trainable(self.model, optim, total_steps,
                                            cfg.parallelism.use_distributed_optimizer)

    @property
    def chunks(self):
        return self.trainable.chunks if self.trainable else self.model

    def _replaying(self, batch: dict, name: str, record: bool, run):
        """run() under routing replay (actor.router_replay.mode; see megarl.megatron.router_replay).

        record: this is the step's first forward (the old-logprob pass): under R2 it records the routing, added to
        the batch as `routed_experts` [N, S, L, k] for the later passes. Any other pass replays batch['routed_experts']
        (R3: the engine's; R2: the recorded ones). Without replay (mode none), the first forward of a batch that
        carries the engine's routes (rollout.return_routed_experts) measures how many of them the trainer's routers
        reproduce. Metrics go to self.replay_metrics as router_replay/<name>_*."""
        mode = self.cfg.actor.router_replay.mode
        routes = batch.get("routed_experts")
        if not self.spec.is_moe or (mode == "none" and not (record and routes is not None)):
            return run()
        action = "measure" if mode == "none" else "record" if record and mode == "R2" else "replay"
        if action == "replay" and routes is None:
            raise ValueError(f"actor.router_replay.mode={mode}: the batch has no routed_experts to replay in the "
                             f"{name} pass" + (" (R3 takes them from the rollout engine)" if mode == "R3" else ""))
        ids = batch["input_ids"]
        need = router_replay.need_mask(sequence_lengths(batch), ids.shape[1])
        router_replay.begin(action, ids.shape[0], ids.shape[1], routes=routes, need=need,
                            num_layers=self.spec.num_layers, topk=self.spec.moe_topk)
        try:
            out = run()
        finally:
            counts = router_replay.end()
        if action == "record":
            batch["routed_experts"] = router_replay.gather_recorded()
        self.replay_metrics.update(router_replay.metrics(name, router_replay.reduce_counts(counts),
                                                         recorded=action == "record"))
        return out

    def _shares(self) -> bool:
        """Whether this pass shares common prefixes (megarl.megatron.forward.shares)."""
        from megarl.megatron.forward import shares

        return shares(self.model)

    def _bins(self, ids: torch.Tensor, batch: dict, max_tokens: int) -> Optional[list]:
        """Token-budget micro-batches that keep rows with a common prefix together, when the model shares them."""
        if not self._shares():
            return None
        return shared_prefix.budget_bins(ids, sequence_lengths(batch).clamp(1, ids.shape[1]), max_tokens)

    def _balanced(self) -> bool:
        """Whether micro-batch pack sizes are agreed beyond one pack (expert parallelism, virtual pipeline stages),
        so fixed micro-batches are dealt by tokens into the fewest packs that the largest of them holds
        (megarl.batching.fewest_groups): no pack grows, the padding and the count shrink."""
        return expert_parallel() or len(self.chunks) > 1

    def _pipeline_groups(self) -> int:
        """What the update's micro-batch count must divide by: PP under virtual pipeline stages (the interleaved
        schedule's groups), else 1."""
        from megatron.core import parallel_state as ps

        return ps.get_pipeline_model_parallel_world_size() if len(self.chunks) > 1 else 1

    def _update(self, batch: dict, rt: DataParallelRank, mini_batch_size: int, micro_batch_size: int, epochs: int,
                shuffle_seed: Optional[int], agg_mode: str, make_loss, max_tokens: Optional[int] = None) -> dict:
        """ppo_epochs passes over the batch in mini-batches; micro-batches of a fixed size, or of up to `max_tokens`
        real tokens each (dynamic batch size); every micro-batch runs packed (train_step.forward_step)."""
        n = batch["input_ids"].shape[0]
        all_lengths = sequence_lengths(batch).tolist()
        out = []
        for epoch in range(epochs):
            gen = torch.Generator().manual_seed(shuffle_seed + epoch) if shuffle_seed is not None else None
            # at expert parallelism each mini-batch's rows are dealt over the DP ranks by tokens (rows_over_ranks)
            balance = all_lengths if expert_parallel() else None
            for rows in mini_batch_rows(n, mini_batch_size, rt.dp_size, rt.dp_rank, gen, balance):
                # routes stay in the batch: routing replay reads them by row_index
                share = {**select_rows({k: v for k, v in batch.items() if k != "routed_experts"}, rows),
                         "row_index": rows}
                lengths = sequence_lengths(share).clamp(1, share["input_ids"].shape[1]).tolist()
                if max_tokens:
                    # at expert parallelism the count is agreed first; shared prefixes then share within a bin
                    bins = expert_bins(lengths, max_tokens) or self._bins(share["input_ids"], share, max_tokens)
                    micro = split_by_token_budget(share, max_tokens, bins)
                elif self._shares():  # rows of one prompt side by side, so a micro-batch holds whole groups
                    micro = split_micro(select_rows(share, rows.argsort()), micro_batch_size)
                elif self._balanced():  # pack sizes are agreed: the rows dealt by tokens into the fewest packs
                    fixed = [list(range(i, min(len(lengths), i + micro_batch_size)))
                             for i in range(0, len(lengths), micro_batch_size)]
                    micro = split_by_token_budget(share, 0, fewest_groups(lengths, fixed, agreed_max,
                                                                          self._pipeline_groups()))
                else:
                    micro = split_micro(share, micro_batch_size)
                micro = [m if m["input_ids"].shape[0] else _idle_micro_batch(share) for m in micro]
                denominator = loss_denominator([m["response_mask"] for m in micro], agg_mode)
                out.append(train_mini_batch(self.trainable, micro, make_loss(denominator)))
        return _average(out)


class OffloadAroundRollout:
    """The trainer's states in pinned host memory while the engine generates (actor.offload, critic.offload,
    ref.offload; megarl.megatron.offload does the moving).

    The trainer calls `offload()` after each weight sync, before the engine wakes its KV cache (and once before the
    engine starts), and `onload()` before the next forward and before a checkpoint is written. Both are no-ops when
    nothing is configured or nothing is offloaded; `metrics()` reports the last round trip."""

    def __init__(self, cfg: MegarlConfig, actor=None, critic=None, ref=None):
        from megarl.megatron.offload import StateOffloader

        self.offloaders = []
        for worker, offload in ((actor, cfg.actor.offload), (critic, cfg.critic.offload)):
            if worker is not None and offload.any:
                t = worker.trainable
                self.offloaders.append(StateOffloader(t.chunks, t.optimizer, params=offload.params,
                                                      grads=offload.grads, optimizer_states=offload.optimizer))
        if ref is not None and cfg.ref.offload:
            chunks = ref.chunks if isinstance(ref.chunks, (list, tuple)) else [ref.chunks]
            self.offloaders.append(StateOffloader(chunks, None, params=True, grads=False, optimizer_states=False))
        self._metrics: dict = {}

    @property
    def active(self) -> bool:
        return bool(self.offloaders)

    @property
    def offloaded(self) -> bool:
        return any(o.offloaded for o in self.offloaders)

    def offload(self) -> dict:
        if not self.offloaders or self.offloaded:
            return {}
        stats = [o.offload() for o in self.offloaders]
        self._metrics.update({"offload/bytes": float(sum(s["bytes"] for s in stats)),
                              "offload/freed_gib": sum(s["freed_bytes"] for s in stats) / 2 ** 30,
                              "timing/offload_s": sum(s["seconds"] for s in stats)})
        return dict(self._metrics)

    def onload(self) -> dict:
        if not self.offloaded:
            return {}
        stats = [o.onload() for o in self.offloaders]
        self._metrics["timing/onload_s"] = sum(s["seconds"] for s in stats)
        return dict(self._metrics)

    def metrics(self) -> dict:
        return dict(self._metrics)


def run_optimizer_steps(cfg: MegarlConfig, epochs: int) -> int:
    """Optimizer steps of a whole RL run for a model updated `epochs` times per mini-batch: the LR schedule steps once
    per optimizer step, so its decay must span all of them, not trainer.total_steps (with several mini-batches per
    step it would otherwise reach min_lr a fraction of the way into the run)."""
    return cfg.trainer.total_steps * epochs * (cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)


class PolicyWorker(_Worker):
    """The actor (trainable; with actor.lora, a frozen base plus adapters unless use_lora=False) or the frozen
    reference policy."""

    def __init__(self, hf_dir: str, cfg: MegarlConfig, trainable: bool, optim: Optional[OptimConfig] = None,
                 total_steps: Optional[int] = None, use_lora: bool = True,
                 log_prob_micro_batch_size: Optional[int] = None):
        super().__init__(hf_dir, cfg, False, (optim or cfg.actor.optim) if trainable else None,
                         total_steps or run_optimizer_steps(cfg, cfg.actor.ppo_epochs),
                         lora_settings(cfg) if trainable and use_lora else None)
        self.cfg = cfg
        self.log_prob_micro_batch_size = log_prob_micro_batch_size  # None: the actor's or the reference's setting
        self.loss_settings = PolicyLossSettings.from_config(cfg, self.spec.vocab_size)

    def reference(self) -> "ReferenceView":
        """The reference policy of a LoRA actor: this model with its adapters disabled (no second model)."""
        if self.lora is None:
            raise ValueError("reference() is the LoRA actor's base; without actor.lora build a frozen PolicyWorker")
        return ReferenceView(self)

    def log_probs(self, batch: dict, rt: DataParallelRank, sum_pi_squared: bool = False):
        """Logprobs [N, T] of every token given its prefix, at the rollout temperature. sum_pi_squared: also
        sum_v pi(v)^2 [N, T] at each position (optimal_token_baseline), returned as a pair."""
        micro = self.log_prob_micro_batch_size or (
            self.cfg.rollout.log_prob_micro_batch_size_per_gpu if self.trainable is not None
            else self.cfg.ref.log_prob_micro_batch_size_per_gpu)
        t = self.loss_settings.temperature
        ids = batch["input_ids"]
        actor = self.trainable is not None
        name = "old_log_prob" if actor else "ref"
        images = images_of(batch)
        if sum_pi_squared:  # beside each logprob, as a trailing pair
            both = self._replaying(batch, name, actor, lambda: _forward_only(
                self.cfg, rt, batch, lambda x, mb, lens: token_logprobs_and_sum_pi_squared(
                    self.chunks, x, mb, t, lengths=lens, vision=images()), micro,
                ids.shape[1] - 1, trailing=(2,), share=self._shares()))
            return both[..., 0].contiguous(), both[..., 1].contiguous()
        return self._replaying(batch, name, actor, lambda: _forward_only(
            self.cfg, rt, batch, lambda x, mb, lens: token_logprobs(self.chunks, x, mb, t, lengths=lens,
                                                                    vision=images()), micro,
            ids.shape[1] - 1, share=self._shares()))

    def update(self, batch: dict, rt: DataParallelRank, step: int, on_policy: bool = False) -> dict:
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
        metrics = self._replaying(batch, "update", False, lambda: self._update(
            batch, rt, a.ppo_mini_batch_size * n, a.ppo_micro_batch_size_per_gpu, a.ppo_epochs, seed, a.loss_agg_mode,
            partial(PolicyLoss, self.loss_settings, max_response_length=self.cfg.rollout.response_length,
                    on_policy_log_probs=kept),
            per_micro_batch(self.cfg, a.ppo_max_token_len_per_gpu) if a.use_dynamic_bsz else None))
        if on_policy:
            device = next(self.chunks[0].parameters()).device
            batch["old_log_probs"] = _assemble_rows(kept, batch["response_mask"], device)
        return {**{f"actor/{k}": v for k, v in metrics.items()}, **self.replay_metrics}

    def export(self, bucket_bytes: int) -> Iterator[list]:
        from megarl.bridge.exporter import export_hf_weights

        return export_hf_weights(self.chunks, self.spec, bucket_bytes)


class ReferenceView:
    """The reference policy as the LoRA actor's base weights: log_probs with the adapters switched off."""

    def __init__(self, actor: PolicyWorker):
        self.actor = actor

    @property
    def replay_metrics(self) -> dict:
        """Nothing of its own: its passes' router_replay/ref_* metrics are the actor's (reported with its update)."""
        return {}

    def log_probs(self, batch: dict, rt: DataParallelRank) -> torch.Tensor:
        from megarl.lora.layers import adapters_disabled

        a = self.actor
        micro = self.actor.cfg.ref.log_prob_micro_batch_size_per_gpu
        t = a.loss_settings.temperature
        ids = batch["input_ids"]
        images = images_of(batch)
        with adapters_disabled(a.chunks):  # the same forward as a reference model's: token budgets, routing replay
            return a._replaying(batch, "ref", False, lambda: _forward_only(
                a.cfg, rt, batch, lambda x, mb, lens: token_logprobs(a.chunks, x, mb, t, lengths=lens,
                                                                     vision=images()), micro,
                ids.shape[1] - 1, share=a._shares()))


class CriticWorker(_Worker):
    def __init__(self, hf_dir: str, cfg: MegarlConfig):
        super().__init__(hf_dir, cfg, True, cfg.critic.optim, run_optimizer_steps(cfg, cfg.critic.ppo_epochs))
        self.cfg = cfg

    def values(self, batch: dict, rt: DataParallelRank) -> torch.Tensor:
        """V(prefix up to t) aligned with logprob positions: [N, T]."""
        micro = self.cfg.rollout.log_prob_micro_batch_size_per_gpu
        s = batch["input_ids"].shape[1]
        return _forward_only(self.cfg, rt, batch,
                             lambda x, mb, lens: _cut(token_values(self.chunks, x, mb, lengths=lens), x.shape[1] - 1),
                             micro, s - 1, share=self._shares())

    def update(self, batch: dict, rt: DataParallelRank, step: int) -> dict:
        c, n = self.cfg.critic, self.cfg.rollout.n
        metrics = self._update(batch, rt, self.cfg.actor.ppo_mini_batch_size * n, c.ppo_micro_batch_size_per_gpu,
                               c.ppo_epochs, None, c.loss_agg_mode,
                               partial(ValueLoss, c.cliprange_value, c.loss_agg_mode,
                                       max_response_length=self.cfg.rollout.response_length))
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
