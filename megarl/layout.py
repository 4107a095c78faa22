"""The trainer's Megatron parallel layout, computed once: model-parallel size (TP*PP*CP), data-parallel size, expert
tensor/data-parallel sizes. Pure (no torch.distributed): config checks, resolve, runtime, plan, verify and import use
it, before or without any process group."""
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
