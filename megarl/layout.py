"""The trainer's Megatron parallel layout, computed once: model-parallel size (TP*PP*CP), data-parallel size, expert
tensor/data-parallel sizes; where colocated engine replicas run over the trainer's ranks (EngineTopology); and which
node and GPUs each engine replica computes on (engine_devices). Pure (no torch.distributed, no CUDA): config checks,
resolve, runtime, plan, verify, import and the weight sync use them, before or without any process group."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence


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


class DeviceShortage(ValueError):
    """A layout that asks a node for more GPUs than it has; key, value, rule and fix as `megarl validate` reports
    them."""

    def __init__(self, key: str, value: Any, rule: str, fix: str):
        super().__init__(f"{key} = {value!r}: {rule} -> {fix}")
        self.key, self.value, self.rule, self.fix = key, value, rule, fix


def _gpu_list(devices: Sequence[str]) -> str:
    """'0-7' for a run of three or more consecutive indices, else '2,3' (UUIDs as they are)."""
    if len(devices) >= 3 and all(d.isdigit() for d in devices) \
            and [int(d) for d in devices] == list(range(int(devices[0]), int(devices[0]) + len(devices))):
        return f"{devices[0]}-{devices[-1]}"
    return ",".join(devices)


@dataclass(frozen=True)
class EngineDevices:
    """The GPUs of one engine replica. parts: (node, its GPUs there) in rank order; the first part is on the node of
    the trainer rank that starts the replica, and its GPUs are what the replica's process is given to see
    (CUDA_VISIBLE_DEVICES); a replica whose TP group runs on past that node has more parts. A Ray-hosted replica has no
    parts: Ray picks a node and num_gpus GPUs of it."""

    replica: int
    num_gpus: int
    parts: tuple = ()

    @classmethod
    def on_cpu(cls, replica: int, node: int) -> "EngineDevices":
        """A CPU engine replica started on `node` (the node index of the trainer rank that starts it): no GPUs, and
        its start line still names the node."""
        return cls(replica, 0, ((node, ()),))

    @property
    def node(self) -> Optional[int]:
        return self.parts[0][0] if self.parts else None

    @property
    def devices(self) -> Optional[tuple]:
        """The GPUs the replica's process sees, as CUDA_VISIBLE_DEVICES names them (None: Ray assigns them)."""
        return self.parts[0][1] if self.parts else None

    def describe(self) -> str:
        """'replica 1: node 0, GPUs 2,3' (one line per replica in `megarl validate` and the engine's start line)."""
        if not self.parts:
            return (f"replica {self.replica}: {self.num_gpus} GPU{'s' if self.num_gpus > 1 else ''} of one node, "
                    f"placed by Ray (num_gpus={self.num_gpus})")
        if len(self.parts) == 1:
            if not self.devices:
                return f"replica {self.replica}: node {self.node}, no GPU (CPU engine)"
            return f"replica {self.replica}: node {self.node}, GPUs {_gpu_list(self.devices)}"
        if len({devices for _, devices in self.parts}) == 1:
            return (f"replica {self.replica}: nodes {self.parts[0][0]}-{self.parts[-1][0]}, GPUs "
                    f"{_gpu_list(self.devices)} of each")
        return f"replica {self.replica}: " + "; ".join(f"node {n}, GPUs {_gpu_list(d)}" for n, d in self.parts)

    def check_assigned(self, gpu_ids: Sequence) -> None:
        """A Ray-hosted replica's GPUs as Ray assigned them (ray.get_gpu_ids()) against the layout; ValueError unless
        there are num_gpus of them (its TP group would not have a GPU per worker)."""
        if len(gpu_ids) != self.num_gpus:
            raise ValueError(f"Ray gave engine replica {self.replica} {len(gpu_ids)} GPU(s) ({list(gpu_ids)}); the "
                             f"layout gives it {self.num_gpus}, one per engine TP worker: see that the Ray nodes "
                             "advertise their GPUs (ray start --num-gpus) and nothing overrides Ray's "
                             "CUDA_VISIBLE_DEVICES")


def engine_devices(*, ranks_per_node: int, engine_tp: int, replicas: int, placement: str,
                   visible: Optional[Sequence[str]] = None) -> list:
    """Each engine replica's node and GPUs (EngineDevices), on nodes whose GPUs are `visible` (as CUDA_VISIBLE_DEVICES
    names them; default: ranks_per_node GPUs, "0" ...). Trainer rank k of a node computes on the node's k-th GPU
    (LOCAL_RANK -> device) and nodes hold consecutive ranks, as torchrun places them.

    placement:
      colocated  replica r spans trainer ranks [r*TP, (r+1)*TP) and computes on their GPUs: on an 8-GPU node at TP2,
                 replica 1 gets GPUs 2,3 (and replica 5, on the next node, its GPUs 2,3 again).
      separate   trainer rank r starts replica r (engine processes on GPUs of their own): on its node, after the
                 trainer ranks' GPUs, the node's j-th replica gets the j-th TP of the GPUs left.
      ray        Ray-hosted: each replica is one placement-group bundle of TP GPUs, which Ray puts on one node; Ray
                 picks the GPUs (and sets CUDA_VISIBLE_DEVICES itself).
    Raises DeviceShortage where a node would need more GPUs than it has."""
    visible = tuple(str(d) for d in (visible if visible is not None else range(ranks_per_node)))
    gpus, tp = len(visible), engine_tp
    where = f"a node has {gpus} GPUs (trainer.n_gpus_per_node)"
    if placement == "ray":
        if tp > gpus:
            raise DeviceShortage("rollout.tensor_model_parallel_size", tp, f"a Ray-hosted engine replica is one "
                                 f"placement-group bundle of {tp} GPUs, which Ray places on one node, and {where}; the "
                                 "Ray nodes are taken to be of the trainer's kind, so Ray could never place it",
                                 f"use an engine TP of at most {gpus}")
        return [EngineDevices(r, tp) for r in range(replicas)]
    if ranks_per_node > gpus:
        raise DeviceShortage("trainer.n_gpus_per_node", ranks_per_node, f"each trainer rank of a node computes on a "
                             f"GPU of its own, and the node shows {gpus} ({','.join(visible)})",
                             f"set it to at most {gpus}, or make every GPU of the node visible")
    if placement == "colocated":
        out = []
        for r in range(replicas):
            parts: dict = {}
            for rank in range(r * tp, (r + 1) * tp):
                parts.setdefault(rank // ranks_per_node, []).append(visible[rank % ranks_per_node])
            out.append(EngineDevices(r, tp, tuple((n, tuple(d)) for n, d in parts.items())))
        return out
    if placement != "separate":
        raise ValueError(f"placement={placement!r}: expected colocated, separate or ray")
    own = visible[ranks_per_node:]  # the GPUs the node's trainer ranks leave
    busiest = min(replicas, ranks_per_node)  # replicas started on one node (node 0 has the most)
    if busiest * tp > len(own):
        raise DeviceShortage("rollout.placement", "separate", f"engines placed separately compute on GPUs of their "
                             f"own beside the trainer's: node 0 holds {ranks_per_node} trainer ranks and starts "
                             f"{busiest} engine replica(s) of TP {tp}, {ranks_per_node + busiest * tp} GPUs, and "
                             f"{where}", "host the engines on nodes of their own (rollout.mode=ray), or colocate them "
                             "(rollout.placement=colocated)")
    return [EngineDevices(r, tp, ((r // ranks_per_node, own[(r % ranks_per_node) * tp:(r % ranks_per_node + 1) * tp]),))
            for r in range(replicas)]
