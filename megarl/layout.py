"""The trainer's Megatron parallel layout, computed once: model-parallel size (TP*PP*CP), data-parallel size, expert
tensor/data-parallel sizes; and where colocated engine replicas run over the trainer's ranks (EngineTopology). Pure
(no torch.distributed): config checks, resolve, runtime, plan, verify, import and the weight sync use them, before or
without any process group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class Layout:
    """A Megatron parallel layout. data_parallel_size is derived from the world size."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: Optional[int] = None
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: Optional[int] = None
    # uneven pipeline stages (verl's / megatron-core's names): the other stages share the remaining layers evenly
    num_layers_in_first_pipeline_stage: Optional[int] = None
    num_layers_in_last_pipeline_stage: Optional[int] = None

    @classmethod
    def of(cls, parallelism: Any) -> "Layout":
        """The layout of a recipe's `parallelism` section (megarl.config.schema.ParallelismConfig)."""
        return cls(**{name: getattr(parallelism, name) for name in cls.__dataclass_fields__})

    @property
    def model_parallel_size(self) -> int:
        """TP * PP * CP: the ranks that hold one copy of the model."""
        return self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size

    @property
    def expert_tensor(self) -> int:
        """Expert tensor-parallel size (Megatron's default: the TP size)."""
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def expert_model_parallel_span(self) -> int:
        """Expert TP * EP * PP: the ranks that hold one copy of every expert."""
        return self.expert_tensor * self.expert_model_parallel_size * self.pipeline_model_parallel_size

    def stage_layers(self, num_layers: int) -> list:
        """Decoder layers per pipeline stage; raises ValueError naming the setting when they do not split."""
        return stage_layer_counts(num_layers, self.pipeline_model_parallel_size,
                                  self.num_layers_in_first_pipeline_stage, self.num_layers_in_last_pipeline_stage)

    def fits(self, world_size: int) -> bool:
        """Whether `world_size` ranks split into this layout (dense and expert)."""
        return world_size % self.model_parallel_size == 0 and world_size % self.expert_model_parallel_span == 0

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.model_parallel_size:
            raise ValueError(
                f"world size {world_size} is not divisible by TP*PP*CP = {self.tensor_model_parallel_size}*"
                f"{self.pipeline_model_parallel_size}*{self.context_parallel_size} = {self.model_parallel_size}; "
                "launch a multiple of that many ranks or change the layout")
        return world_size // self.model_parallel_size

    def expert_data_parallel_size(self, world_size: int) -> int:
        """Copies of each expert: world / (expert TP * EP * PP)."""
        if world_size % self.expert_model_parallel_span:
            raise ValueError(f"world size {world_size} is not divisible by expert TP * EP * PP = {self.expert_tensor}*"
                             f"{self.expert_model_parallel_size}*{self.pipeline_model_parallel_size}")
        return world_size // self.expert_model_parallel_span


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list:
    """[layers of stage 0, ..., stage pp-1], megatron-core's rule: `first` / `last` layers on the first / last stage
    when given, the remaining layers split evenly over the other stages (e.g. 61 layers, PP16, first 1, last 4:
    [1, 4 x 14, 4]... with 56 over 14 middle stages)."""
    if pp == 1:
        if first not in (None, num_layers) or last not in (None, num_layers):
            raise ValueError("parallelism.num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1")
        return [num_layers]
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise ValueError(f"parallelism.num_layers_in_{name}_pipeline_stage={value} must be >= 1")
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - (first or 0) - (last or 0)
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and (rest % middle or rest == 0)):
        raise ValueError(
            f"num_hidden_layers={num_layers} does not split over pipeline_model_parallel_size={pp} with "
            f"num_layers_in_first_pipeline_stage={first}, num_layers_in_last_pipeline_stage={last}: the "
            f"{rest} remaining layers must split evenly (and non-empty) over the {middle} other stages")
    per = rest // middle if middle else 0
    counts = [per] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def layer_stages(counts: list) -> list:
    """The pipeline stage of every global layer, from stage_layer_counts."""
    return [stage for stage, n in enumerate(counts) for _ in range(n)]


@dataclass(frozen=True)
class EngineTopology:
    """Where engine replicas run over the trainer's ranks (colocated)."""

    world: int
    engine_tp: int
    replicas: int

    def __post_init__(self):
        if self.replicas * self.engine_tp > self.world:
            raise ValueError(f"{self.replicas} engine replicas x engine TP {self.engine_tp} need "
                             f"{self.replicas * self.engine_tp} ranks; the trainer has {self.world}")

    def replica_of(self, rank: int) -> Optional[int]:
        return rank // self.engine_tp if rank < self.replicas * self.engine_tp else None

    def owner(self, replica: int) -> int:
        return replica * self.engine_tp

    def owns(self, rank: int) -> bool:
        return rank in [self.owner(r) for r in range(self.replicas)]

    def members(self, replica: int) -> list:
        return list(range(replica * self.engine_tp, (replica + 1) * self.engine_tp))

    def prompt_slice(self, replica: int, num_prompts: int) -> slice:
        """Replica r's contiguous share of a step's prompts (balanced; the first replicas take the remainder)."""
        base, extra = divmod(num_prompts, self.replicas)
        start = replica * base + min(replica, extra)
        return slice(start, start + base + (replica < extra))
