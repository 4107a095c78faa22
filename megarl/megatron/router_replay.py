"""Routing replay for MoE models (actor.router_replay.mode: R2, R3).

An MoE trainer and its rollout engine can send the same token to different experts (a near tie in the router logits
flips under another kernel or precision), and then the trainer's logprob of a sampled token is not the engine's: the
importance ratios drift. Routing replay makes a forward use a given routing instead of the router's top-k:

- R2 (verl's name): the trainer's first forward of a step (the old-logprob pass) records every token's experts; the
  reference forward and the update forwards replay them, so the policy ratio compares the same expert paths.
- R3: the engine's routing (vLLM's routed experts) is replayed in the old-logprob, reference and update forwards.
  The replay here takes any given routes; megarl's engine does not return vLLM's yet (vLLM 0.32 returns them only
  from its Model Runner V2, which needs Triton), so `megarl validate` refuses R3 for now.

Routes are kept per sample in one layout whatever the parallel layout: `routes [N, S, L, k]` (int, -1 = no route)
indexed by row, token position and decoder layer (0-based, as vLLM's routed experts), beside `need [N, S]` (bool, the
positions whose hidden states reach a loss: every real token but the last). Each megatron router (one per MoE layer on
this pipeline stage) takes its layer's slice of the current micro-batch, in the router's own token order: micro-batches
are packed (megarl.megatron.packing), so the router sees the pack's tokens in packed order (rows end to end), and
under sequence parallelism only this TP rank's contiguous chunk of the pack. A token without a route (-1 in any slot) falls back to the router's own choice and is counted.

Replay keeps the router's gate math: the replayed experts' scores are gathered from the router's scores (as
megatron-core's RouterReplay does), so gradients still reach the router weights through the probabilities. It needs
megatron's unfused top-k path (moe_router_fusion=False) and no activation recompute (a recomputed forward would replay
another micro-batch's routes); `megarl validate` checks both.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

MODES = ("none", "R2", "R3")


def replay_topk(scores: torch.Tensor, probs: torch.Tensor, indices: torch.Tensor, target: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Replace the router's top-k with `target` where a token has a complete route.

    scores: [T, E] the router's scores (what top-k ran on); probs, indices: [T, k] the router's own top-k;
    target: [T, k] the experts to use (-1 anywhere in a row: no route, keep the router's choice).
    Returns (probs [T, k], indices [T, k], replayed [T] bool). Replayed rows gather their scores from `scores` at the
    target experts; the other rows are the router's, unchanged."""
    replayed = (target >= 0).all(dim=-1)
    idx = torch.where(replayed.unsqueeze(-1), target.to(indices.dtype), indices)
    gathered = scores.gather(1, idx)
    return torch.where(replayed.unsqueeze(-1), gathered.to(probs.dtype), probs), idx, replayed


def same_experts(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """[T] bool: rows of a and b ([T, k] expert ids) name the same set of experts (the order within top-k is free)."""
    return (a.sort(dim=-1).values == b.to(a.dtype).sort(dim=-1).values).all(dim=-1)


@dataclass
class ReplayCounts:
    """Counted over (token, MoE layer) pairs at needed positions."""

    needed: int = 0          # pairs whose output reaches a loss
    with_route: int = 0      # ... that had a complete recorded route
    agree: int = 0           # ... whose route the router's own choice matched (agreement without replay)
    replayed: int = 0        # ... that were replayed (0 when only recording / measuring)

    def add(self, other: "ReplayCounts") -> None:
        for k in ("needed", "with_route", "agree", "replayed"):
            setattr(self, k, getattr(self, k) + getattr(other, k))


@dataclass
class ReplayState:
    """What the routers of this process read during one pass (one per process: the routers find it here).

    action: "off" (the router decides, nothing counted), "measure" (the router decides; its choice is compared with
    the routes), "record" (the router decides and its choice is written to `recorded`), "replay" (the routes are used).
    """

    action: str = "off"
    routes: Optional[torch.Tensor] = None   # [N, S, L, k] of the pass's rows (global rows)
    need: Optional[torch.Tensor] = None     # [N, S]
    recorded: Optional[torch.Tensor] = None  # [N, S, L, k] int16, -1 = not recorded here
    pass_rows: Optional[torch.Tensor] = None  # global row ids of the tokens a forward-only call gets [n]
    counts: ReplayCounts = field(default_factory=ReplayCounts)
    # the current micro-batch's slices (set by `micro_batch`)
    _mb_routes: Optional[torch.Tensor] = None  # [1, P, L, k] in packed order
    _mb_need: Optional[torch.Tensor] = None    # [1, P]
    _mb_rows: Optional[tuple] = None           # (global row [P], column [P]) of each packed token, row -1: none


STATE = ReplayState()


def micro_batch(rows: torch.Tensor, positions: torch.Tensor) -> None:
    """Point the routers at a packed micro-batch (megarl.megatron.packing): token p of the pack is the token at column
    positions[p] of global row rows[p] (rows [P], positions [P]; rows -1: the pack's end padding, or a padding row).
    Positions past the routes' width have no route. Called by megarl's forward steps right before the model."""
    st = STATE
    if st.action == "off":
        return
    rows, positions = rows.long().cpu(), positions.long().cpu()
    width = st.need.shape[1] if st.need is not None else int(positions.max()) + 1
    ok = (rows >= 0) & (positions < width)
    r, c = rows.clamp(min=0), positions.clamp(max=width - 1)
    st._mb_rows = torch.where(ok, rows, torch.full_like(rows, -1)), c
    need = torch.zeros(len(rows), dtype=torch.bool)
    if st.need is not None:
        need = st.need[r, c] & ok
    st._mb_need = need.unsqueeze(0)  # [1, P]: the pack's batch dimension of 1
    if st.routes is not None:
        out = st.routes[r, c].long()
        out[~ok] = -1
        st._mb_routes = out.unsqueeze(0)  # [1, P, L, k]
    else:
        st._mb_routes = None


class LayerReplay:
    """Stands in for megatron-core's RouterReplay on one router (router.router_replay): same get_replay_topk contract,
    reading megarl's STATE. layer: the decoder layer (0-based) of the router."""

    def __init__(self, layer: int, sequence_parallel: bool):
        self.layer = layer
        self.sequence_parallel = sequence_parallel

    def _token_view(self, t: torch.Tensor, num_tokens: int, device) -> torch.Tensor:
        """This router's tokens of a [b, s, ...] micro-batch tensor, flattened as the router sees them: [T, ...]."""
        b, s = t.shape[:2]
        s_local = num_tokens // b
        start = 0
        if self.sequence_parallel and s_local != s:
            from megatron.core import parallel_state as ps

            start = ps.get_tensor_model_parallel_rank() * s_local
        part = t[:, start:start + s_local].transpose(0, 1)  # [s_local, b, ...]
        return part.reshape(num_tokens, *t.shape[2:]).to(device), start, s_local

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk: Callable = None):
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        st = STATE
        if st.action == "off" or st._mb_need is None:
            return probs, indices
        num_tokens = scores.shape[0]
        need, start, s_local = self._token_view(st._mb_need, num_tokens, scores.device)
        counts = ReplayCounts(needed=int(need.sum()))
        if st.action == "record":  # this router's pack tokens start .. start + s_local, back to (row, column)
            rows, cols = (x[start:start + s_local] for x in st._mb_rows)
            mine = indices.detach().reshape(s_local, topk).to(torch.int16).cpu()
            ok = rows >= 0
            st.recorded[rows[ok], cols[ok], self.layer] = mine[ok]
            st.counts.add(counts)
            return probs, indices
        if st._mb_routes is None:
            st.counts.add(counts)
            return probs, indices
        target, _, _ = self._token_view(st._mb_routes[:, :, self.layer], num_tokens, scores.device)
        has = (target >= 0).all(dim=-1) & need
        counts.with_route = int(has.sum())
        counts.agree = int((same_experts(indices, target.clamp(min=0)) & has).sum())
        if st.action == "replay":
            target = torch.where(has.unsqueeze(-1), target, torch.full_like(target, -1))
            probs, indices, replayed = replay_topk(scores, probs, indices, target)
            counts.replayed = int(replayed.sum())
        st.counts.add(counts)
        return probs, indices


def install(chunks) -> int:
    """Give every MoE router of `chunks` (GPTModel chunks, wrapped or not) a LayerReplay. Returns how many.

    The model must be built with moe_enable_routing_replay=True (megatron then routes top-k through
    router.router_replay) and moe_router_fusion=False."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    n = 0
    for chunk in chunks:
        config = chunk.config
        if not config.moe_enable_routing_replay or config.moe_router_fusion:
            raise ValueError("routing replay needs the model built with moe_enable_routing_replay=True and "
                             "moe_router_fusion=False")
        sp = bool(config.sequence_parallel) and config.tensor_model_parallel_size > 1
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = LayerReplay(int(module.layer_number) - 1, sp)
                n += 1
    # megatron keeps every RouterReplay it built in a class-level list; megarl's stand-ins replace them
    RouterReplay.clear_global_router_replay_instances()
    return n


def begin(action: str, num_rows: int, seq_len: int, routes: Optional[torch.Tensor] = None,
          need: Optional[torch.Tensor] = None, num_layers: int = 0, topk: int = 0) -> None:
    """Start a pass over a batch of `num_rows` rows. record: `recorded` becomes [N, S, num_layers, topk] of -1."""
    if action not in ("off", "measure", "record", "replay"):
        raise ValueError(f"routing replay action {action!r}")
    STATE.action = action
    STATE.routes = routes
    STATE.need = need
    STATE.counts = ReplayCounts()
    STATE.recorded = (torch.full((num_rows, seq_len, num_layers, topk), -1, dtype=torch.int16)
                      if action == "record" else None)
    STATE._mb_routes = STATE._mb_need = STATE._mb_rows = None


def end() -> ReplayCounts:
    """Finish the pass: the counts summed over all ranks; the state goes back to off."""
    counts = STATE.counts
    STATE.action = "off"
    STATE.routes = STATE.need = STATE.pass_rows = None
    STATE._mb_routes = STATE._mb_need = STATE._mb_rows = None
    return counts


def gather_recorded() -> torch.Tensor:
    """The routes recorded in the pass, assembled on every rank: [N, S, L, k] int16 (-1 where no rank recorded).

    Each rank wrote its own rows (DP), its own layers (PP), under sequence parallelism its own sequence chunk (TP)
    and under context parallelism its own chunks of each row (CP); a max over those groups assembles them exactly
    (the unwritten entries are -1, the written ones >= 0)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megarl import distributed

    out = STATE.recorded.to(device=distributed.compute_device(), dtype=torch.int32)
    groups = [ps.get_data_parallel_group(), ps.get_pipeline_model_parallel_group()]
    if ps.get_tensor_model_parallel_world_size() > 1:
        groups.append(ps.get_tensor_model_parallel_group())
    if ps.get_context_parallel_world_size() > 1:
        groups.append(ps.get_context_parallel_group())
    for g in groups:
        if dist.get_world_size(g) > 1:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=g)
    STATE.recorded = None
    return out.to("cpu", torch.int16)


def reduce_counts(counts: ReplayCounts) -> ReplayCounts:
    """Sum the counts over every rank (each rank counted its own tokens and layers; without sequence parallelism the
    TP ranks count the same tokens, which leaves the shares unchanged)."""
    import torch.distributed as dist

    from megarl import distributed

    t = torch.tensor([counts.needed, counts.with_route, counts.agree, counts.replayed], dtype=torch.float64,
                     device=distributed.compute_device())
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    v = [int(x) for x in t.tolist()]
    return ReplayCounts(*v)


def metrics(prefix: str, counts: ReplayCounts, recorded: bool = False) -> dict:
    """router_replay/<prefix>_* metrics of one pass: agreement (router's own choice == route, over routed pairs),
    replayed_share (replayed pairs / needed pairs), fallback_share (needed pairs without a route). recorded: a
    recording pass (R2's old-logprob pass), which has no routes to fall back from: replayed_share (0) only."""
    needed = max(counts.needed, 1)
    out = {f"router_replay/{prefix}_replayed_share": counts.replayed / needed}
    if recorded:
        return out
    out[f"router_replay/{prefix}_fallback_share"] = (counts.needed - counts.with_route) / needed
    if counts.with_route:
        out[f"router_replay/{prefix}_agreement"] = counts.agree / counts.with_route
    return out


def need_mask(lengths: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[N, S] bool: positions 0..length-2 of each row (every real token whose hidden state reaches a logprob; the last
    real token predicts nothing the loss reads). lengths: [N] real tokens per row."""
    pos = torch.arange(seq_len).unsqueeze(0)
    return pos < (lengths.view(-1, 1) - 1)
