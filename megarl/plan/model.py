"""The model step: the cluster, where the trainer and the engines run, and who holds which of the model's bytes.

The parameter bytes each Megatron rank holds and the bytes each GPU sends, receives and loads into its engine worker
per weight sync come from the sync plan (megarl.sync.plan.build_plan, the plan the live sync runs), so the two never
disagree about who holds what. Engines (colocated): rollout.data_parallel_size replicas of engine TP GPUs each, by
default every GPU. Engines placed separately (rollout.placement=separate, Ray mode): replicas x engine TP GPUs beyond
the trainer's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megarl.bridge.hf_config import CONFIG_FILE, ArchSpec, BridgeError, read_config_json
from megarl.layout import Layout
from megarl.sync.plan import DTYPE_BYTES, SyncPlan, build_plan

GIB = 1024 ** 3


class PlanError(ValueError):
    """The recipe or the cluster cannot be planned (a missing config.json, a layout the plan refuses)."""


@dataclass(frozen=True)
class Cluster:
    """nodes x gpus_per_node GPUs of gpu_mem_gib GiB each, linked at link_gbps GB/s."""

    nodes: int
    gpus_per_node: int
    gpu_mem_gib: float
    link_gbps: float

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def gpu_bytes(self) -> int:
        """One GPU's memory."""
        return int(self.gpu_mem_gib * GIB)


@dataclass(frozen=True)
class Placement:
    """The trainer's layout on its GPUs, and the engine replicas on the same GPUs or on GPUs of their own."""

    layout: Layout
    world: int  # trainer GPUs
    tp: int
    pp: int
    ep: int
    vpp: int  # virtual pipeline stages per rank (1: plain 1F1B)
    dp: int
    edp: int  # expert data-parallel size
    separate: bool  # engines on GPUs of their own
    replicas: int
    engine_tp: int
    engine_ep: int
    generating: int  # GPUs hosting an engine worker: colocated, the first of the trainer's; else GPUs of their own
    dtype: str  # the trainer's parameters, a megarl.sync.plan.DTYPE_BYTES name
    engine_dtype: str
    cp: int = 1  # context-parallel size: each sequence's tokens split over CP ranks
    te: bool = True  # Transformer Engine layers (its context-parallel attention) rather than megatron's local ones

    @property
    def dp_cp(self) -> int:
        """The DP x CP ranks that hold the same dense weights: gradients are reduced and the distributed optimizer
        shards dense states over them (CP ranks see other tokens of the same sequences, as DP ranks other sequences)."""
        return self.dp * self.cp

    @property
    def pbytes(self) -> int:
        """Bytes of one trainer parameter."""
        return DTYPE_BYTES[self.dtype]

    @property
    def ebytes(self) -> int:
        """Bytes of one engine parameter."""
        return DTYPE_BYTES[self.engine_dtype]

    @property
    def engine_ratio(self) -> float:
        """Engine bytes per trainer byte of the same weights (the sync plan counts the trainer's dtype)."""
        return self.ebytes / self.pbytes


@dataclass(frozen=True)
class Weights:
    """Parameter bytes per pipeline stage on its most loaded rank, and each GPU's bytes per weight sync (trainer
    dtype), from the sync plan."""

    sync: SyncPlan
    dense: list[int]
    expert: list[int]
    held: list[int]  # dense and expert together, on the rank holding the most of both
    sent: dict[int, int]
    received: dict[int, int]  # from other GPUs
    loaded: dict[int, int]  # into the GPU's engine worker

    @property
    def spec(self) -> ArchSpec:
        return self.sync.mapping.spec

    @property
    def n_params(self) -> int:
        return self.sync.total_bytes // self.sync.element_bytes

    @property
    def n_expert(self) -> int:
        return sum(math.prod(shape) for name, shape in self.sync.mapping.hf_shapes().items() if ".experts." in name)


def read_json(path, key: str) -> dict:
    """A model's config.json through the bridge's reader; PlanError naming the recipe key when it does not parse."""
    try:
        return read_config_json(path)
    except BridgeError as exc:  # it names the file, what is wrong with it and the fix
        raise PlanError(f"{key}: {exc}") from None


def read_model_config(cfg) -> dict:
    """The policy's config.json: model.config_path, else model.path's, else the tiny model model.create_tiny makes."""
    for key, candidate in (("model.config_path", cfg.model.config_path),
                           ("model.path", cfg.model.path and str(Path(cfg.model.path) / CONFIG_FILE))):
        if candidate and Path(candidate).is_file():
            data = read_json(candidate, key)
            return data.get("text_config", data)
    if cfg.model.create_tiny is not None:  # the tiny model the run will create: its config from the same recipe
        from megarl.bridge.checks import _tiny_vocab
        from megarl.bridge.tiny import tiny_hf_config

        return tiny_hf_config(cfg.model.create_tiny, len(_tiny_vocab(cfg))).to_dict()
    raise PlanError("the planner needs the model's config.json: set model.config_path (a config.json) or a model.path "
                    "that exists on this machine")


def sync_dtype(name: str) -> str:
    """A recipe's dtype ('auto' included) as the sync plan names it."""
    return "float32" if name == "float32" else "bfloat16" if name in ("auto", "bfloat16") else "float16"


def place(cfg, cluster: Cluster) -> Placement:
    """The trainer on the whole cluster (colocated engines) or on its own ranks (separate engines)."""
    p, r = cfg.parallelism, cfg.rollout
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    separate = cfg.engine_placement == "separate"
    world = cfg.world_size if separate else cluster.gpus
    cp = p.context_parallel_size
    layout = Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                    expert_model_parallel_size=ep, expert_tensor_parallel_size=p.expert_tensor_parallel_size,
                    num_layers_in_first_pipeline_stage=p.num_layers_in_first_pipeline_stage,
                    num_layers_in_last_pipeline_stage=p.num_layers_in_last_pipeline_stage)
    if not layout.fits(world):
        raise PlanError(f"{world} trainer GPUs do not split into TP{tp} x PP{pp} x CP{cp} with EP{ep} dividing the "
                        "data-parallel size; change the node count or the layout")
    return Placement(layout, world, tp, pp, ep, p.virtual_pipeline_model_parallel_size or 1,
                     layout.data_parallel_size(world), layout.expert_data_parallel_size(world), separate,
                     cfg.engine_replicas, r.tensor_model_parallel_size, r.expert_model_parallel_size,
                     cfg.engine_replicas * r.tensor_model_parallel_size, sync_dtype(cfg.model.dtype),
                     sync_dtype(r.dtype), cp, uses_te(cfg))


def uses_te(cfg) -> bool:
    """Whether the trainer builds Transformer Engine layers (megarl.megatron.workers.build_options): as
    model.use_transformer_engine says; auto: on a GPU, except for LoRA (its adapters sit on megatron's local layers)."""
    setting = cfg.model.use_transformer_engine
    if setting != "auto":
        return bool(setting)
    return not cfg.actor.lora.enabled and cfg.trainer.device != "cpu"


def gpu_count_reason(pl: Placement, cluster: Cluster) -> Optional[str]:
    if not pl.separate or pl.world + pl.generating <= cluster.gpus:
        return None
    return (f"GPUs: the trainer's {pl.world} ranks (trainer.nnodes * n_gpus_per_node) plus "
            f"{pl.replicas} engine replica(s) x engine TP {pl.engine_tp} = {pl.generating} need "
            f"{pl.world + pl.generating} GPUs; the cluster has {cluster.gpus}")


def _per_stage_max(values: dict[int, int], world: int, pp: int) -> list[int]:
    """The most loaded rank of each pipeline stage (megatron-core order: stage = rank // (world / PP))."""
    per = world // pp
    return [max(values[r] for r in range(s * per, (s + 1) * per)) for s in range(pp)]


def model_weights(hf: dict, pl: Placement) -> Weights:
    """The sync plan of this placement, and what it says each rank holds and each GPU moves (the holdings counted
    from the mapping, megarl.plan.counts, where expert TP differs from TP: the sync plan splits experts over TP)."""
    try:
        sync = build_plan(hf, pl.tp, pl.pp, pl.ep, pl.world, pl.engine_tp, pl.engine_ep, pl.replicas, pl.dtype,
                          separate=pl.separate, first_stage=pl.layout.num_layers_in_first_pipeline_stage,
                          last_stage=pl.layout.num_layers_in_last_pipeline_stage)
    except ValueError as exc:
        raise PlanError(f"the weight-sync plan refuses this layout: {exc}") from None
    dense, expert = sync.held_bytes()
    both = {k: dense[k] + expert[k] for k in dense}
    if pl.layout.expert_tensor != pl.tp:
        # the sync plan splits experts over TP; at another expert TP the trainer holds them as the mapping counts
        from megarl.plan.counts import counted_weights

        counted = counted_weights(hf, pl)
        return Weights(sync, counted.dense, counted.expert, counted.held, *sync.traffic())
    return Weights(sync, _per_stage_max(dense, pl.world, pl.pp), _per_stage_max(expert, pl.world, pl.pp),
                   _per_stage_max(both, pl.world, pl.pp), *sync.traffic())
