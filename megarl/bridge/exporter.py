"""Any megatron layout -> a stream of HF-named full tensors, in bounded-size buckets.

    for bucket in export_hf_weights(model, spec, bucket_bytes=512 << 20):   # on EVERY rank, to the end
        for hf_name, tensor in bucket: ...

This is the one stream that live weight sync (megarl.rollout) and the checkpoint merger consume.

Contract
- A collective: every rank of the job must iterate the generator to exhaustion, in step.
- Order: HF checkpoint order (embeddings, layer 0 .. N-1 with experts in id order, final norm, head), the same on all
  ranks and for every layout; each HF name appears exactly once (tied embeddings: `model.embed_tokens.weight` only).
- dst_rank=None (default): every rank receives every tensor (the buckets are identical on all ranks).
  dst_rank=k: only global rank k receives tensors; the other ranks yield empty lists at the same bucket boundaries.
- Buckets: a bucket is yielded before it would exceed `bucket_bytes`; one tensor group (q/k/v of a layer, gate/up of
  an MLP) never straddles buckets, so a group larger than bucket_bytes comes alone. Tensors are fresh copies (never
  views of parameters), in the model's parameter dtype unless `dtype` is given, on the model's device.
- How: for each megatron tensor the lowest global rank holding TP shard 0 is the source; its TP (expert-TP for
  routed experts) group all-gathers the shards back to back into one buffer (gathers them to dst_rank when it is in
  the group), the source converts them to HF layout (split QKV, split gate/up, strip vocab padding; row splits need
  no copy) and broadcasts (or sends to dst_rank); receivers inside that group (all of them at pure TP) convert their
  own copy instead. Other PP stages and EP ranks only receive.
  Ranks of one machine gather through shared memory (megarl.bridge.local_exchange), not gloo.
Memory per rank: one bucket plus one gathered tensor group (and, on CPU, two shared-memory slots of the largest
shard per member of each gathering group, kept for the next export).
"""
from __future__ import annotations

import math
from typing import Iterator, Optional

import torch
import torch.distributed as dist

from megarl.bridge.hf_config import ArchSpec, BridgeError
from megarl.bridge.importer import model_mapping
from megarl.bridge.local_exchange import host_name, local_exchange
from megarl.bridge.sharding import local_params

DEFAULT_BUCKET_BYTES = 512 << 20


def _ownership(model, mapping) -> tuple:
    """{entry megatron name: [(global rank, tp rank, tp group ranks, dtype)]} gathered from every rank, my params, and
    {global rank: host}."""
    mine = {}
    for lp in local_params(model):
        entry = mapping.entry(lp.name)
        mine.setdefault(entry.megatron, lp)
    rank = dist.get_rank() if dist.is_initialized() else 0
    info = {}
    for name, lp in mine.items():
        split = mapping.by_megatron[name].tp_dim is not None and lp.tp_size > 1
        group_ranks = tuple(dist.get_process_group_ranks(lp.tp_group)) if split else (rank,)
        info[name] = (rank, lp.tp_rank if split else 0, group_ranks, str(lp.param.dtype).replace("torch.", ""))
    if dist.is_initialized() and dist.get_world_size() > 1:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (info, host_name()))
    else:
        gathered = [(info, host_name())]
    table = {}
    for per_rank, _ in gathered:
        for name, owner in per_rank.items():
            table.setdefault(name, []).append(owner)
    return table, mine, {r: host for r, (_, host) in enumerate(gathered)}


@torch.no_grad()
def export_hf_weights(model, spec: ArchSpec, bucket_bytes: int = DEFAULT_BUCKET_BYTES, dst_rank: Optional[int] = None,
                      dtype: Optional[torch.dtype] = None) -> Iterator[list]:
    """Yield lists of (hf_name, full tensor) covering the whole model; see the module docstring for the contract."""
    mapping = model_mapping(model, spec)
    table, mine, hosts = _ownership(model, mapping)
    distributed = dist.is_initialized() and dist.get_world_size() > 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    device = next(iter(mine.values())).param.device if mine else torch.device("cpu")
    bucket, size = [], 0
    for entry in mapping.entries:
        owners = table.get(entry.megatron)
        if not owners:
            raise BridgeError(f"no rank holds {entry.megatron} (HF {list(entry.hf)}): the model does not match "
                              f"{spec.architecture} with this config")
        src, _, group, dt = min((o for o in owners if o[1] == 0), key=lambda o: o[0])
        param_dtype = getattr(torch, dt)
        shapes = [mapping.hf_shape(h) for h in entry.hf]
        numels = [math.prod(s) for s in shapes]
        nbytes = sum(numels) * torch.tensor([], dtype=dtype or param_dtype).element_size()
        if size and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        receive = dst_rank is None or rank == dst_rank
        # receivers that are in the gathering group already hold every shard: they convert locally, no broadcast
        local = dst_rank in group if dst_rank is not None else len(group) == world
        hf = None
        if rank in group:
            lp = mine[entry.megatron]
            shard = lp.value()  # base + LoRA delta when the weight has adapters
            if len(group) > 1:  # gathered back to back into one buffer: dim-0 splits need no further copy
                gathered = torch.empty((len(group) * shard.shape[0],) + tuple(shard.shape[1:]), dtype=shard.dtype,
                                       device=shard.device)
                shards = list(gathered.chunk(len(group)))
                # ranks of one machine exchange through shared memory (gloo would go through loopback TCP)
                ex = local_exchange(lp.tp_group, group, hosts) if shard.device.type == "cpu" else None
                if dst_rank is not None and local:  # only dst_rank needs the shards: gather, not all-gather
                    if ex is not None:
                        ex.gather(shards if rank == dst_rank else None, shard, dst_rank)
                    else:
                        dist.gather(shard.contiguous(), shards if rank == dst_rank else None, dst=dst_rank,
                                    group=lp.tp_group)
                elif ex is not None:
                    ex.all_gather_into_tensor(gathered, shard)
                else:
                    dist.all_gather_into_tensor(gathered, shard.contiguous(), group=lp.tp_group)
            else:
                shards = [shard]
            if (rank == src and not local) or (local and receive):  # who uses the converted tensors
                hf = mapping.to_hf(entry, shards, views=True)
        if distributed and not local:
            if rank == src:
                flat = torch.cat([t.reshape(-1) for _, t in hf])
            else:
                flat = torch.empty(sum(numels), dtype=param_dtype, device=device)
            if dst_rank is None:
                dist.broadcast(flat, src=src)
            elif rank == src:
                dist.send(flat, dst=dst_rank)
            elif rank == dst_rank:
                dist.recv(flat, src=src)
            if receive:
                hf = [(h, t.view(s)) for h, t, s in zip(entry.hf, flat.split(numels), shapes)]
        elif receive:  # converted here: never hand out a view of a parameter
            param = shard.untyped_storage().data_ptr()
            hf = [(h, t.clone() if t.untyped_storage().data_ptr() == param else t) for h, t in hf]
        size += nbytes
        if receive:
            bucket.extend((h, t if dtype is None else t.to(dtype)) for h, t in hf)
    if size:
        yield bucket


def export_to_dict(model, spec: ArchSpec, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                   dst_rank: Optional[int] = None) -> dict:
    """The whole stream collected into {hf_name: tensor} (tests, small models; a collective like the generator)."""
    out = {}
    for bucket in export_hf_weights(model, spec, bucket_bytes, dst_rank):
        for name, tensor in bucket:
            out[name] = tensor
    return out
