"""What both sides of a weight sync agree on: the shared-memory files the trainer writes and the engine workers map.

The trainer side (megarl.sync.transports.colocated, remote, adapters) writes these files; the engine side (the worker
extension, megarl.rollout.vllm.worker_ext) reads them. Both import this module and neither imports the other, so either
side can change its own mechanics as long as the files stay as described here. Only file names and small metadata cross
vLLM's RPC.

Bucket file (`layout_bucket`, read through `open_bucket` and `region`): every tensor of a bucket has a region shaped
like the FULL HF tensor at `offset`, of which only the box the receiving worker reads is written (the file is sparse:
the rest takes no memory). vLLM's loaders slice full HF tensors by their rank, so they read exactly the written box and
the loaders of every architecture work unchanged. The worker's metadata: {"path", "size", "tensors": [[hf_name, dtype,
full shape, offset, need box, [boxes written in this bucket]]]}.

Adapter file (`write_adapter_file`, `read_adapter_file`): the whole PEFT-named LoRA tensors of one sync, one after the
other in the engine's dtype: {"path", "size", "bytes", "tensors": [[PEFT key, dtype, shape, offset]]}.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass
from typing import Sequence

import torch

ALIGN = 64  # every region starts on a cache line: aligned for a view of any dtype, and no line shared by two regions


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def region(buf: torch.Tensor, dtype: str, shape, offset: int) -> torch.Tensor:
    """The full-shape view of one tensor's region in a bucket buffer."""
    dt = getattr(torch, dtype)
    nbytes = math.prod(int(d) for d in shape) * _element_size(dt)
    return buf[offset: offset + nbytes].view(dt).view(tuple(shape))


def _require_file(path: str, size: int, what: str, writer: str) -> None:
    if not os.path.isfile(path) or os.path.getsize(path) != size:
        raise FileNotFoundError(f"{what} {path} of {size} bytes is missing (the trainer rank {writer} did not write "
                                "it)")


# ----------------------------------------------------------------------------------------------------------------------
# Bucket files


@dataclass
class BucketFile:
    """One receiving rank's file of one bucket: {hf_name: (offset, dtype, shape)} regions plus the metadata its
    worker reads."""

    path: str
    size: int
    regions: dict
    meta: dict


def layout_bucket(moves: Sequence, dst: int, path: str, shapes: dict, dtypes: dict, needs: dict) -> BucketFile:
    """The file of rank `dst` for one bucket: one full-shape region per tensor (sparse: only `dst`'s boxes are
    written), in the order the tensors appear in the bucket. moves: megarl.sync.shards.Move (dst, hf, box)."""
    regions, boxes, offset = {}, {}, 0
    for mv in moves:
        if mv.dst != dst:
            continue
        if mv.hf not in regions:
            regions[mv.hf] = (offset, dtypes[mv.hf], tuple(shapes[mv.hf]))
            nbytes = math.prod(int(n) for n in shapes[mv.hf]) * _element_size(getattr(torch, dtypes[mv.hf]))
            offset += _aligned(nbytes)
            boxes[mv.hf] = []
        boxes[mv.hf].append([list(b) for b in mv.box])
    tensors = [[name, dt, list(shape), off, [list(b) for b in needs[name]], boxes[name]]
               for name, (off, dt, shape) in regions.items()]
    size = max(offset, ALIGN)
    return BucketFile(path, size, regions, {"path": path, "size": size, "tensors": tensors})


def open_bucket(path: str, size: int) -> torch.Tensor:
    """Map a bucket file its writer created, and unlink it: the mapping stays valid, and nothing is left in shared
    memory once the tensors are released."""
    _require_file(path, size, "weight bucket file", "hosting this worker")
    buf = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    os.unlink(path)
    return buf


# ----------------------------------------------------------------------------------------------------------------------
# Adapter files


def adapter_bytes(tensors: dict, dtype: torch.dtype) -> int:
    """Bytes of `tensors` ({PEFT key: tensor}) in `dtype`."""
    return sum(t.numel() for t in tensors.values()) * _element_size(dtype)


def write_adapter_file(tensors: dict, path: str, dtype: torch.dtype) -> dict:
    """Write the adapters into one shared-memory file; returns its meta {"path", "size", "bytes", "tensors": [[name,
    dtype, shape, offset]]} (what `read_adapter_file` and megarl_add_adapter read). Tensors are cast to `dtype` (the
    engine's)."""
    entries, offset = [], 0
    name_of_dtype = str(dtype).replace("torch.", "")
    for name in sorted(tensors):
        entries.append([name, name_of_dtype, list(tensors[name].shape), offset])
        offset += _aligned(tensors[name].numel() * _element_size(dtype))
    total = max(offset, ALIGN)
    buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
    for name, dt, shape, off in entries:
        region(buf, dt, shape, off).copy_(tensors[name].detach().to(dtype))
    return {"path": path, "size": total, "bytes": adapter_bytes(tensors, dtype), "tensors": entries}


def read_adapter_file(meta: dict) -> dict:
    """{PEFT key: tensor} of a file written by `write_adapter_file` (copies: the file is removed after the load)."""
    _require_file(meta["path"], int(meta["size"]), "adapter file", "owning this engine")
    buf = torch.from_file(meta["path"], shared=False, size=int(meta["size"]), dtype=torch.uint8)
    return {name: region(buf, dtype, shape, int(offset)).clone() for name, dtype, shape, offset in meta["tensors"]}


# ----------------------------------------------------------------------------------------------------------------------
# Cores


@contextlib.contextmanager
def half_threads_during_sync():
    """Halve this process's torch threads (at least one) for the duration. Both sides of a weight sync run at once on
    the same cores (the trainer writes bucket b+1 while the engine loads bucket b), and two copies that each start
    every core's OpenMP thread oversubscribe them (threads spin-wait at their barriers). Measured on 2 cores (418 MiB,
    in-place load, memcpy floor 0.043 s): 0.195 s with both sides at 2 threads, 0.142-0.160 s with the writer at 1,
    0.137 s with both at 1. torch._C's setter: vLLM's CPU worker replaces torch.set_num_threads with a no-op."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(max(1, threads // 2))
    try:
        yield
    finally:
        torch._C.set_num_threads(threads)
