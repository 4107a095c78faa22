"""Host memory of one trainer node, per phase, line by line (the busiest node: its GPUs are the most loaded stage's).

  processes                 (trainer ranks + engine worker processes on the node) * HOST_PROCESS_GIB
  pinned offload buffers    offloaded bytes per GPU * trainer GPUs on the node, every phase (kept once allocated)
  shared-memory sync slots  receive_bucket_bytes(B, shard) per engine worker on the node, every phase (mapped for the
                            run); with actor.lora.sync=adapter one adapter file per replica owner instead
  routes (R2/R3)            the rollout batch's routes on every trainer process, in the log-prob and update phases;
                            with engine routes, each replica owner's recorder in the generate phase
  checkpoint staging        actor and critic shards (parameters, fp32 master copy, Adam moments) of every trainer GPU
                            on the node, in the checkpoint save phase
  delta updates: last sent  engines placed apart with delta updates and rollout.delta_kept_on=host: what each
                            trainer GPU last sent of its pieces (engine dtype), kept for the run (the engine host
                            keeps its replica's share: the engine's node, not this one)
(formulas of each term: megarl.plan.terms). Engines placed separately run on nodes of their own: a trainer node then
has no engine process, slot file or recorder.
"""
from __future__ import annotations

from megarl.plan.memory import ModelMemory
from megarl.plan.model import Cluster, Placement
from megarl.plan.terms import (delta_kept_bytes, delta_kept_where, engine_route_recorder_bytes,
                               host_process_bytes, receive_bucket_bytes, route_bytes)

PHASES = ("generate", "old/ref log-probs", "update", "weight sync", "checkpoint save")


def host_phases(cfg, spec, pl: Placement, cluster: Cluster, models: list[ModelMemory], stage: int, offloaded: int,
                engine_shard: int, adapter_bytes, sent: float = 0) -> dict[str, dict[str, int]]:
    """Named host lines of each phase on a node whose GPUs are pipeline stage `stage`'s (bytes)."""
    gpus = min(cluster.gpus_per_node, pl.world)
    workers = 0 if pl.separate else min(cluster.gpus_per_node, pl.generating)
    owners = -(-workers // pl.engine_tp) if workers else 0
    base = {"processes (trainer ranks and engine workers)": host_process_bytes(gpus + workers)}
    if offloaded:
        base["pinned offload buffers"] = offloaded * gpus
    if workers and adapter_bytes is None:
        bucket = cfg.rollout.update_weights_bucket_megabytes << 20
        base["shared-memory sync slots"] = receive_bucket_bytes(bucket, engine_shard) * workers
    elif owners and adapter_bytes is not None:
        base["shared-memory adapter file"] = adapter_bytes * owners
    if delta_kept_where(cfg.rollout, pl, adapter_bytes) == "host":
        base["delta updates: last sent pieces"] = delta_kept_bytes(sent) * gpus
    out = {p: dict(base) for p in PHASES}
    spec_routes = routes_shape(cfg, spec)
    if spec_routes is not None:
        rows, seq, layers, k = spec_routes
        for p in ("old/ref log-probs", "update"):
            out[p]["rollout batch routes (int16)"] = route_bytes(rows, seq, layers, k) * gpus
        if cfg.routes_from_engine and owners:
            out["generate"]["engine route recorders (int16)"] = \
                engine_route_recorder_bytes(rows, pl.replicas, seq, layers, k) * owners
    out["checkpoint save"]["checkpoint staging (saved shards)"] = \
        sum(m.params[stage] + m.optim[stage] for m in models if m.trains) * gpus
    return out


def routes_shape(cfg, spec):
    """(rows, tokens, layers, top_k) of the routes a MoE run keeps (R2, R3 or engine routes), None without them."""
    if not spec.is_moe or (cfg.actor.router_replay.mode == "none" and not cfg.routes_from_engine):
        return None
    r = cfg.rollout
    return cfg.data.train_batch_size * r.n, r.prompt_length + r.response_length, spec.num_layers, spec.moe_topk


def r2_gather_bytes(cfg, spec) -> int:
    """R2's int32 all-reduce copy of the recorded routes on the device, in the old-logprob pass (0 otherwise)."""
    shape = routes_shape(cfg, spec)
    return route_bytes(*shape, elem=4) if shape is not None and cfg.actor.router_replay.mode == "R2" else 0
