"""Placed weight writes: the trainer rank hosting an engine worker writes each received shard straight into the
worker's live parameters, one copy instead of two (trainer -> bucket file -> parameter) and no loader walk per sync.

Where a CPU engine takes its weights in place (plain weights: megarl.rollout.vllm.patches.direct_update_blockers), each
worker, once, at plan time:
1. moves its parameters into one shared-memory file, the arena (`share_parameters`): the same bytes, now mapped by
   the worker and by its hosting trainer rank;
2. finds where vLLM's own weight loader puts every HF tensor it reads (`probe_placements`): the loader is run on
   placeholder tensors of the full HF shape while a dispatch mode records, instead of running, each copy into a
   parameter: which box of the HF tensor lands at which strided view of the arena. This covers every loader
   (fused q/k/v and gate/up, padded vocabulary, replicated KV heads, tied heads) without re-writing one of them.
A tensor whose loader does anything else with the data (converts it, reshapes it, writes outside the parameters)
is not placed: it keeps the bucket-file path, so the result is always what the loader itself would have produced.
Writes the loader makes without the data (zeroing the padded vocabulary rows) are run once, where no copy lands.

The records name a region (a storage of the worker's parameters) and a view of it, so they hold wherever the
parameters live: on CPU the arena is the one region and the host writes into it; on GPU the regions are the
worker's own parameter storages, which only the worker itself resolves at each load (megarl.sync.pull).
"""
from __future__ import annotations

import os
from typing import Callable, Iterable, Optional, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megarl.sync.boxes import Box, box_numel, intersect, relative_slices

_ALIGN = 64
_FILLS = {torch.ops.aten.fill_.Scalar, torch.ops.aten.fill_.Tensor, torch.ops.aten.zero_.default}

# A placement record: (box of the HF tensor, region, byte offset in the region, sizes, strides (elements), dtype name);
# rec[1:] is the view spec of a region that `region_viewer` resolves.
Record = tuple


def _written(func, args, kwargs) -> list:
    """The tensors an aten op writes (its mutable arguments)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out.extend(v for v in value if isinstance(v, torch.Tensor))
    return out


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def shm_free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def share_parameters(params: Iterable[torch.Tensor], path: str) -> torch.Tensor:
    """Move every (distinct) parameter's storage into a new shared-memory file at `path`, keeping each parameter's
    shape, strides and offset (parameters sharing a storage keep sharing it). Returns the file's mapping (bytes),
    the storage every parameter now lives in.
    The file's pages are reserved first: a full /dev/shm fails here, with a clear error, instead of at a write."""
    storages: dict = {}  # storage ptr -> (storage, [params])
    for p in params:
        if p.numel() == 0 or p.device.type != "cpu":
            continue
        entry = storages.setdefault(_ptr(p), (p.untyped_storage(), []))
        if not any(q is p for q in entry[1]):
            entry[1].append(p)
    offsets, size = {}, 0
    for ptr, (storage, _) in storages.items():
        offsets[ptr] = size
        size += -(-storage.nbytes() // _ALIGN) * _ALIGN
    size = max(size, _ALIGN)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        os.unlink(path)
        raise OSError(f"cannot reserve {size} bytes for the engine's weights in {os.path.dirname(path)} "
                      f"({shm_free_bytes(os.path.dirname(path))} free): {exc}") from exc
    os.close(fd)
    arena = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)
    with torch.no_grad():
        for ptr, (storage, members) in storages.items():
            n = storage.nbytes()
            dst = arena[offsets[ptr]: offsets[ptr] + n]
            dst.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
            for p in members:
                typed = dst.view(p.dtype)  # as_strided's offset counts from the storage's start, not the view's
                p.data = typed.as_strided(p.shape, p.stride(), typed.storage_offset() + p.storage_offset())
    return arena


def parameter_regions(params: Iterable[torch.Tensor]) -> list:
    """The distinct storages of `params` (in order of first use), each as a uint8 tensor over the whole storage."""
    out: dict = {}
    for p in params:
        if p.numel() and _ptr(p) not in out:
            out[_ptr(p)] = torch.empty(0, dtype=torch.uint8, device=p.device).set_(p.untyped_storage())
    return list(out.values())


def source_box(src: torch.Tensor, full: torch.Tensor) -> Optional[Box]:
    """The box of `full` (contiguous) that `src` views, or None if `src` is not a plain sub-box of it."""
    if _ptr(src) != _ptr(full) or src.dtype != full.dtype or src.dim() != full.dim():
        return None
    if any(src.stride(d) != full.stride(d) for d in range(src.dim()) if src.shape[d] > 1):
        return None
    offset = src.storage_offset() - full.storage_offset()
    if offset < 0:
        return None
    start = []
    for stride in full.stride():
        start.append(offset // stride)
        offset %= stride
    box = tuple((int(s), int(s) + int(n)) for s, n in zip(start, src.shape))
    return box if all(stop <= n for (_, stop), n in zip(box, full.shape)) else None


class _Probe(TorchDispatchMode):
    """Records (and does not run) the writes into the arena and every write of the placeholder's data."""

    def __init__(self, region_ptrs: dict):
        super().__init__()
        self.regions = region_ptrs  # storage address -> region index
        self.full: Optional[torch.Tensor] = None
        self.copies: list = []  # (source box, dst view spec)
        self.fills: list = []  # (dst view spec, value)
        self.refused: list = []  # why the current tensor cannot be placed

    def spec(self, t: torch.Tensor) -> tuple:
        return (self.regions[_ptr(t)], t.storage_offset() * t.element_size(), tuple(t.shape), tuple(t.stride()),
                str(t.dtype).replace("torch.", ""))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        written = _written(func, args, kwargs)
        into_arena = [t for t in written if _ptr(t) in self.regions]
        reads_data = self.full is not None and any(
            isinstance(a, torch.Tensor) and _ptr(a) == _ptr(self.full) for a in list(args) + list(kwargs.values()))
        if not into_arena and not (written and reads_data):
            return func(*args, **kwargs)
        if func is torch.ops.aten.copy_.default and into_arena:
            dst, src = args[0], args[1]
            box = source_box(src, self.full) if reads_data else None
            if box is None or tuple(dst.shape) != tuple(src.shape) or dst.dtype != src.dtype:
                self.refused.append("the loader copies a converted or reshaped copy of the tensor, not a box of it")
            else:
                self.copies.append((box, self.spec(dst)))
        elif func in _FILLS and into_arena and not reads_data:
            value = args[1] if len(args) > 1 else 0
            self.fills.append((self.spec(args[0]), float(value) if not isinstance(value, torch.Tensor)
                               else float(value.item())))
        else:
            self.refused.append(f"the loader writes with {func}")
        return written[0] if written else None


def region_viewer(regions: Sequence[torch.Tensor]) -> Callable[[tuple], torch.Tensor]:
    """spec (region, byte offset, sizes, strides, dtype name) -> that view of the region (uint8 tensors, offset 0)."""
    typed: dict = {}

    def view(spec: tuple) -> torch.Tensor:
        index, byte_offset, sizes, strides, dtype = spec
        t = typed.get((index, dtype))
        if t is None:
            dt, region = getattr(torch, dtype), regions[index]
            usable = region.numel() - region.numel() % torch.empty((), dtype=dt).element_size()
            t = typed[(index, dtype)] = region[:usable].view(dt)
        return t.as_strided(tuple(sizes), tuple(strides), byte_offset // t.element_size())

    return view


def probe_placements(load: Callable[[list], object], regions: Sequence[torch.Tensor], needs: dict) -> tuple:
    """Where `load` (vLLM's model.load_weights) puts each HF tensor, for this worker's `needs` {hf name: (dtype,
    full shape, need box)}; parameters live in `regions` (the arena of share_parameters, or parameter_regions).
    Returns ({hf name: [Record]}, {hf name: why not placed}). Nothing in the regions changes, except fills that no
    copy covers (run as the loader would)."""
    probe = _Probe({_ptr(r): i for i, r in enumerate(regions)})
    placed, refused, fills = {}, {}, []
    for name, (dtype, shape, need) in needs.items():
        need = tuple(tuple(b) for b in need)
        # never written: its pages stay unmapped (on the parameters' device, so the loader's copies stay plain copies)
        probe.full = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=regions[0].device)
        probe.copies, probe.fills, probe.refused = [], [], []
        with torch.no_grad(), probe:
            load([(name, probe.full)])
        boxes = [box for box, _ in probe.copies]
        distinct = list(dict.fromkeys(boxes))
        problem = probe.refused[0] if probe.refused else _coverage_problem(distinct, need)
        if problem:
            refused[name] = problem
            continue
        placed[name] = [(box,) + spec for box, spec in probe.copies]
        fills.extend(probe.fills)
    probe.full = None
    _run_uncovered_fills(regions, fills, [rec for recs in placed.values() for rec in recs])
    return placed, refused


def _coverage_problem(boxes: Sequence[Box], need: Box) -> Optional[str]:
    if not boxes:
        return "the loader copies nothing of it into a parameter"
    if any(intersect(b, need) != b for b in boxes):
        return f"the loader reads outside the planned box {need}"
    if any(intersect(a, b) is not None for i, a in enumerate(boxes) for b in boxes[i + 1:]):
        return "the loader reads overlapping boxes"
    if sum(box_numel(b) for b in boxes) != box_numel(need):
        return f"the loader reads less than the planned box {need}"
    return None


def _span(spec: tuple) -> tuple:
    """[first, end) in elements of the region a view spec (region, byte offset, sizes, strides, dtype) touches."""
    _, byte_offset, sizes, strides, dtype = spec
    first = byte_offset // torch.empty((), dtype=getattr(torch, dtype)).element_size()
    return first, first + 1 + sum((n - 1) * st for n, st in zip(sizes, strides) if n > 0)


def _run_uncovered_fills(regions: Sequence[torch.Tensor], fills: list, records: list) -> None:
    """Run the loader's fills (vocabulary padding set to 0) on the elements no placed copy writes; the mask spans
    only the fill and the copies that reach into it (the padded parameter, not the whole region)."""
    views = region_viewer(regions)
    copies = [(rec[1:], _span(rec[1:])) for rec in records]
    for spec, value in fills:
        lo, hi = _span(spec)
        near = [(c, span) for c, span in copies if c[0] == spec[0] and span[0] < hi and span[1] > lo]
        if any(c[4] != spec[4] for c, _ in near):
            continue  # another dtype over the same bytes: leave them as the copies will write them
        first = min([lo] + [span[0] for _, span in near])
        covered = torch.zeros(max([hi] + [span[1] for _, span in near]) - first, dtype=torch.bool,
                              device=regions[spec[0]].device)
        for (_, _, sizes, strides, _), span in near:
            covered.as_strided(sizes, strides, span[0] - first).fill_(True)
        with torch.no_grad():
            views(spec)[~covered.as_strided(spec[2], spec[3], lo - first)] = value


def write_placed(views: Callable[[tuple], torch.Tensor], records: Sequence[Record], box: Box,
                 piece: torch.Tensor) -> int:
    """Copy `piece` (the part `box` of an HF tensor) to where the engine's loader would have put it (`views`: a
    region_viewer of the worker's regions). Returns the bytes written."""
    written = 0
    for rec in records:
        src_box, spec = rec[0], rec[1:]
        common = intersect(box, src_box)
        if common is not None:
            views(spec)[relative_slices(common, src_box)].copy_(piece[relative_slices(common, box)])
            written += box_numel(common) * piece.element_size()
    return written
