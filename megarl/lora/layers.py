"""LoRA adapters on megatron-core's column- and row-parallel linears, at any TP/PP/EP layout.

    targets = apply_lora(model, spec, LoraSettings(rank=16, alpha=32, target_modules=("q_proj", "v_proj")))
    with adapters_disabled(model): ...          # the base model: the reference policy, no second copy in memory
    state = gather_adapters(model)              # {PEFT key: full tensor} on global rank 0 (collective)

How. Each targeted megatron linear (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`, experts' too) gets a
child module `lora` (LoraAdapters) holding one (A, B) pair per HF projection it fuses, and a forward hook that adds
`scaling * B(A(dropout(x)))` to the linear's output. The base parameters keep their names (the bridge, the sync and
the checkpoint see the same model), are frozen (requires_grad False: megatron's DDP gives them no gradient buffer
and its optimizer no state) and every adapter parameter carries `megarl_lora = True`.

TP. Column-parallel (weight rows split): A is replicated, B is split on dim 0 exactly as the weight's rows (for the
fused q/k/v: the per-KV-group interleave of the bridge mapping, built from each projection's B chunk and zero blocks
for the other projections' columns). h = x A^T is the same on every TP rank; its gradient is summed over TP by
megatron's copy-to-TP region (with sequence parallelism x is this rank's sequence chunk: h is all-gathered over the
sequence, whose backward reduce-scatters, and A's gradient is a partial sum over the sequence that megatron's
finalize_model_grads all-reduces because A carries `sequence_parallel = True`). Row-parallel (weight columns split):
A is split on dim 1 like the weight, B replicated; h = x_r A_r^T is summed over TP (all-reduce, or reduce-scatter
over the sequence with sequence parallelism, where B then carries `sequence_parallel`). Split parameters carry
megatron's tensor-parallel attributes so the gradient norm counts them once per shard, replicated ones once.

Experts (SequentialMLP, expert-TP 1): each expert's linears get their own adapters; they live on the expert's EP rank
and carry the base weight's `allreduce` flag (gradients reduced over the expert-data-parallel group, as the expert
weights are).
"""
from __future__ import annotations

import contextlib
import math
import zlib
from typing import Optional

import torch
import torch.nn.functional as F

from megarl.bridge.mapping import Mapping
from megarl.lora.targets import LoraError, LoraSettings, Target, TargetSet, resolve_targets


def _full_init(settings: LoraSettings, target: Target, which: str) -> torch.Tensor:
    """The whole (unsplit) initial A or B of a target, identical at every layout: a generator seeded by the settings'
    seed and the HF weight name. A: PEFT's kaiming-uniform (a=sqrt 5: U(-1/sqrt(in), 1/sqrt(in))) or N(0, 1/r);
    B: zeros (the adapted model starts as the base)."""
    shape = target.shapes(settings.rank)[which]
    if which == "B":
        return torch.zeros(shape)
    g = torch.Generator().manual_seed((settings.seed * 1_000_003 + zlib.crc32(target.hf_weight.encode())) % 2**63)
    if settings.init == "gaussian":
        return torch.randn(shape, generator=g) / settings.rank
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(shape, generator=g) * 2 - 1) * bound


class LoraAdapters(torch.nn.Module):
    """The adapters of one megatron linear (see the module docstring). `targets`: the targeted HF projections of its
    tensor, in slot order; tp_rank/tp_size/group: the linear's (expert-)TP placement."""

    def __init__(self, linear, targets: list, mapping: Mapping, settings: LoraSettings, tp_rank: int, tp_size: int):
        super().__init__()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        self.entry = targets[0].entry
        self.parallel = targets[0].parallel
        self.targets = targets
        self.mapping, self.tp_rank, self.tp_size = mapping, tp_rank, tp_size
        self.group = linear.tp_group
        self.scaling = settings.scaling
        self.rank = settings.rank
        self.enabled = True
        self.explicit_expert_comm = bool(getattr(linear, "explicit_expert_comm", False))
        if self.explicit_expert_comm and tp_size > 1:
            raise LoraError("LoRA on routed experts needs expert_tensor_parallel_size=1 (got "
                            f"{tp_size}); set parallelism.expert_tensor_parallel_size=1 or drop the expert projections "
                            "from actor.lora.target_modules")
        self.sequence_parallel = bool(getattr(linear, "sequence_parallel", False)) and tp_size > 1 and \
            not self.explicit_expert_comm
        self.dropout = torch.nn.Dropout(settings.dropout) if settings.dropout > 0 else None
        self.lora_A = torch.nn.ParameterDict()
        self.lora_B = torch.nn.ParameterDict()
        split_which, dim = targets[0].split()
        weight = linear.weight
        for t in targets:
            for which, store in (("A", self.lora_A), ("B", self.lora_B)):
                full = _full_init(settings, t, which)
                if which == split_which and tp_size > 1:
                    rng = mapping.hf_chunk_range(t.entry, t.slot, tp_rank, tp_size)
                    if rng is not None:
                        _, lo, hi = rng
                        full = full.narrow(dim, lo, hi - lo)
                p = torch.nn.Parameter(full.to(dtype=weight.dtype, device=weight.device).contiguous())
                p.megarl_lora = True
                if which == split_which and tp_size > 1:
                    set_tensor_model_parallel_attributes(p, True, dim, 1)
                if hasattr(weight, "allreduce"):
                    p.allreduce = weight.allreduce
                if self.sequence_parallel and which != split_which:
                    p.sequence_parallel = True  # a partial sum over this rank's sequence chunk: summed over TP
                store[t.projection] = p

    # ---- the adapted forward -------------------------------------------------------------------------------------
    def _h(self, x: torch.Tensor) -> torch.Tensor:
        """x A^T for every projection, joined on the last dim [..., r * projections]."""
        if self.dropout is None:
            a = torch.cat([self.lora_A[t.projection] for t in self.targets]) if len(self.targets) > 1 else \
                self.lora_A[self.targets[0].projection]
            return F.linear(x, a)
        return torch.cat([F.linear(self.dropout(x), self.lora_A[t.projection]) for t in self.targets], dim=-1)

    def fused_B(self) -> torch.Tensor:
        """This rank's B in the megatron tensor's own row layout [rows of the shard, r * projections] (column-parallel
        linears): each projection's B chunk in its own column block, zero elsewhere, placed by the bridge mapping."""
        r, n = self.rank, len(self.targets)
        by_slot = {t.slot: (i, self.lora_B[t.projection]) for i, t in enumerate(self.targets)}
        parts = []
        for slot, h in enumerate(self.entry.hf):
            if slot in by_slot:
                i, b = by_slot[slot]
                parts.append(F.pad(b, (i * r, (n - 1 - i) * r)))
            else:
                rows = self.mapping.hf_shape(h)[0] // self.tp_size
                parts.append(torch.zeros(rows, r * n, dtype=self._dtype(), device=self._device()))
        return self.mapping.to_megatron(self.entry, parts, self.tp_size)

    def _dtype(self):
        return next(iter(self.lora_B.values())).dtype

    def _device(self):
        return next(iter(self.lora_B.values())).device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The delta to add to the base linear's output for its input x (as the base linear's forward receives it)."""
        from megatron.core import tensor_parallel as tpl

        h = self._h(x)
        if self.parallel == "column":
            if self.tp_size > 1 and not self.explicit_expert_comm:
                if self.sequence_parallel:
                    h = tpl.gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.group)
                else:
                    h = tpl.copy_to_tensor_model_parallel_region(h, group=self.group)
            return F.linear(h, self.fused_B()) * self.scaling
        if self.tp_size > 1 and not self.explicit_expert_comm:
            if self.sequence_parallel:
                h = tpl.reduce_scatter_to_sequence_parallel_region(h, group=self.group)
            else:
                h = tpl.reduce_from_tensor_model_parallel_region(h, group=self.group)
        return F.linear(h, self.lora_B[self.targets[0].projection]) * self.scaling

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """scaling * B A in the layout of this rank's base weight shard (merged sync: base + this)."""
        # scaled in place: the product is a fresh tensor of the base weight's size, and a second one for its scaled
        # copy would double the merged sync's transient per weight
        if self.parallel == "column":
            a = torch.cat([self.lora_A[t.projection] for t in self.targets])
            return (self.fused_B() @ a).mul_(self.scaling)
        t = self.targets[0]
        return (self.lora_B[t.projection] @ self.lora_A[t.projection]).mul_(self.scaling)

    def local_shards(self) -> list:
        """[(PEFT key, this rank's tensor, split dim or None, tp rank, tp size)] of every A and B here."""
        split_which, dim = self.targets[0].split()
        out = []
        for t in self.targets:
            for which, store in (("A", self.lora_A), ("B", self.lora_B)):
                split = which == split_which and self.tp_size > 1
                out.append((t.peft_key(which), store[t.projection], dim if split else None,
                            self.tp_rank if split else 0, self.tp_size if split else 1))
        return out


def _hook(module, args, kwargs, output):
    lora = module.lora
    if not lora.enabled:
        return output
    out, bias = output
    x = args[0] if args else kwargs["input_"]
    return out + lora(x).to(out.dtype), bias


def _sharded_state_dict_with_lora(module, original):
    """The linear's sharded_state_dict with the adapters' TP-split tensors sharded on their split dim (megatron's own
    treats every child tensor of a linear as replicated)."""

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        out = original(prefix=prefix, sharded_offsets=sharded_offsets, metadata=metadata)
        lora = module.lora
        state = lora.state_dict(prefix="lora.", keep_vars=True)
        split_which, dim = lora.targets[0].split()
        axes = {f"lora.lora_{split_which}.{t.projection}": dim for t in lora.targets} if lora.tp_size > 1 else {}
        out.update(make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=module.tp_group,
                                                       dp_cp_group=(metadata or {}).get("dp_cp_group")))
        return out

    return sharded_state_dict


def _require_grad_hook(module, args, output):
    """Frozen embeddings give activations without requires_grad; megatron's full recompute (a reentrant checkpoint)
    would then drop the gradients of adapters inside the recomputed layers. Mark the activations as PEFT does."""
    if torch.is_grad_enabled() and isinstance(output, torch.Tensor) and not output.requires_grad:
        output.requires_grad_(True)
    return output


def apply_lora(model, spec, settings: LoraSettings, head: Optional[str] = None) -> TargetSet:
    """Freeze every base parameter of `model` (a GPTModel or its chunks, before DDP wrapping) and add the adapters of
    `settings` to this rank's targeted linears. Returns the whole model's TargetSet. Call on every rank."""
    from megarl.bridge.importer import model_mapping
    from megarl.bridge.sharding import local_params, unwrap

    chunks = unwrap(model)
    mapping = model_mapping(chunks, spec, head)
    targets = resolve_targets(mapping, settings)
    by_megatron = targets.by_megatron()
    for chunk in chunks:
        for p in chunk.parameters():
            p.requires_grad_(False)
        for lp in local_params([chunk]):
            found = by_megatron.get(lp.name)
            if not found or not lp.local_name.endswith(".weight"):
                continue
            linear = chunk.get_submodule(lp.local_name[: -len(".weight")])
            if hasattr(linear, "lora"):
                continue
            if not hasattr(linear, "tp_group"):
                raise LoraError(f"LoRA supports megatron's local layer spec (ColumnParallelLinear/RowParallelLinear); "
                                f"{lp.local_name} is a {type(linear).__name__}: set model.use_transformer_engine=false")
            linear.lora = LoraAdapters(linear, found, mapping, settings, lp.tp_rank, lp.tp_size)
            linear.register_forward_hook(_hook, with_kwargs=True)
            linear.sharded_state_dict = _sharded_state_dict_with_lora(linear, linear.sharded_state_dict)
            linear.weight.megarl_lora_delta = linear.lora.delta_weight
        if getattr(chunk, "embedding", None) is not None:
            chunk.embedding.register_forward_hook(_require_grad_hook)
        chunk.megarl_lora = settings
    return targets


def lora_modules(model) -> list:
    from megarl.bridge.sharding import unwrap

    return [m for chunk in unwrap(model) for m in chunk.modules() if isinstance(m, LoraAdapters)]


def lora_settings(model) -> Optional[LoraSettings]:
    from megarl.bridge.sharding import unwrap

    chunks = unwrap(model)
    return getattr(chunks[0], "megarl_lora", None) if chunks else None


@contextlib.contextmanager
def adapters_disabled(model):
    """Inside: the model computes with its base weights only (the reference policy of a LoRA actor)."""
    mods = lora_modules(model)
    before = [m.enabled for m in mods]
    for m in mods:
        m.enabled = False
    try:
        yield
    finally:
        for m, b in zip(mods, before):
            m.enabled = b


# ---- moving adapters as PEFT tensors -------------------------------------------------------------------------------
def gather_adapters(model, dst: Optional[int] = 0) -> Optional[dict]:
    """Every adapter tensor of the model as PEFT names it, whole ({key: tensor} in float32 on the CPU), on global rank
    `dst` (None: on every rank); other ranks get None. A collective over the whole job."""
    import torch.distributed as dist

    mine = {}
    for lora in lora_modules(model):
        for key, t, dim, rank, size in lora.local_shards():
            mine.setdefault(key, {})[rank] = (dim, size, t.detach().float().cpu())
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        if dst is None:
            dist.all_gather_object(every, mine)
        else:
            dist.gather_object(mine, every if dist.get_rank() == dst else None, dst=dst)
            if dist.get_rank() != dst:
                return None
    else:
        every = [mine]
    pieces: dict = {}
    for per_rank in every:
        for key, shards in per_rank.items():
            for rank, value in shards.items():
                pieces.setdefault(key, {}).setdefault(rank, value)
    out = {}
    for key, shards in pieces.items():
        dim, size, _ = next(iter(shards.values()))
        if dim is None:
            out[key] = shards[0][2]
        else:
            if len(shards) != size:
                raise LoraError(f"{key}: {len(shards)} of {size} TP shards gathered")
            out[key] = torch.cat([shards[r][2] for r in range(size)], dim=dim)
    return out


@torch.no_grad()
def load_adapters(model, tensors: dict) -> int:
    """Copy whole PEFT-named adapter tensors into this rank's adapters (each rank takes its TP slice). Returns how
    many tensors this rank loaded; a targeted adapter missing from `tensors` is an error."""
    n = 0
    for lora in lora_modules(model):
        split_which, dim = lora.targets[0].split()
        for t in lora.targets:
            for which, store in (("A", lora.lora_A), ("B", lora.lora_B)):
                key = t.peft_key(which)
                if key not in tensors:
                    raise LoraError(f"adapter tensor {key} is missing (the adapter was made for other target_modules?)")
                full = tensors[key]
                expect = t.shapes(lora.rank)[which]
                if tuple(full.shape) != tuple(expect):
                    raise LoraError(f"adapter tensor {key} has shape {list(full.shape)}, expected {list(expect)} "
                                    f"(rank {lora.rank})")
                if which == split_which and lora.tp_size > 1:
                    _, lo, hi = lora.mapping.hf_chunk_range(t.entry, t.slot, lora.tp_rank, lora.tp_size)
                    full = full.narrow(dim, lo, hi - lo)
                store[t.projection].copy_(full)
                n += 1
    return n
