"""One torch_dist checkpoint directory (megatron dist_checkpointing over torch.distributed.checkpoint), read on one
process, tensor by tensor.

The directory's `.metadata` (read by torch's FileSystemReader) lists every saved tensor with its global shape and
dtype, the chunks (boxes of the global tensor) the ranks wrote, and where each chunk's record lies in the shard files.
A read wants a tensor or a slice of its leading dimensions (a stacked layer, an expert):
- where the tensor's chunks are plain tensor records (torch_dist writes nothing else), the overlapping bytes of each
  chunk are read straight into their place in the result: every byte read once, no intermediate copy
  (megarl.checkpoint.chunk_records, which says what that is worth);
- else torch.distributed.checkpoint reads it: its resharding helper (`create_read_items_for_chunk_list`) names the
  saved chunks that overlap the slice and `FileSystemReader.read_data` loads each whole and copies the overlap into
  place. (Megatron saves each expert as a chunk of its own, so a slice of an expert tensor is whole chunks either way.)
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from megarl.checkpoint.chunk_records import box_range, pread_into, pread_rows_into, raw_data_offset


class CheckpointError(ValueError):
    """A checkpoint that cannot be read (incomplete, corrupted, not torch_dist); names the file or tensor and why."""


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (start, n) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, start, n)
    return t


class _Into:
    """What FileSystemReader.read_data needs of a LoadPlanner: each read item lands in its box of `target`."""

    def __init__(self, target: torch.Tensor):
        self.target = target
        self.covered = 0

    def resolve_tensor(self, item) -> torch.Tensor:
        return _narrow(self.target, item.dest_offsets, item.lengths)

    def commit_tensor(self, item, tensor) -> None:
        self.covered += math.prod(item.lengths)

    def load_bytes(self, item, value) -> None:  # pragma: no cover - megatron saves tensors under these keys
        raise CheckpointError(f"{item.storage_index.fqn}: expected a tensor, found bytes")


@dataclass(frozen=True)
class _Chunk:
    """One saved chunk of a tensor: its box in the global tensor and where its raw bytes lie (None: not raw)."""

    offsets: tuple
    sizes: tuple
    path: str  # relative file name
    data_offset: Optional[int]  # byte offset of the chunk's row-major data in the file


class DistCheckpoint:
    """The tensors of one torch_dist directory: names, global shapes, dtypes, reads of a tensor or of a slice of its
    leading dimensions."""

    def __init__(self, directory: str | Path):
        # torch.distributed.checkpoint (and the sympy it pulls in) only where a checkpoint is opened: every `megarl`
        # command's parser imports the merger's arguments
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"{self.dir}: missing (the checkpoint has no such model directory)")
        if not (self.dir / ".metadata").is_file():
            raise CheckpointError(f"{self.dir}/.metadata: missing (not a torch_dist checkpoint, or a partial copy)")
        self.reader = FileSystemReader(str(self.dir))
        try:
            self.metadata = self.reader.read_metadata()
        except Exception as exc:
            raise CheckpointError(f"{self.dir}/.metadata: unreadable ({type(exc).__name__}: {exc}); the checkpoint "
                                  "is corrupted or truncated") from exc
        self.reader.set_up_storage_reader(self.metadata, is_coordinator=True)
        self.tensors = {k: v for k, v in self.metadata.state_dict_metadata.items()
                        if isinstance(v, TensorStorageMetadata)}
        self._files: dict = {}  # relative path -> open file
        self._chunks: dict = {}  # key -> [_Chunk]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()

    def _file(self, rel: str):
        if rel not in self._files:
            self._files[rel] = open(self.dir / rel, "rb")
        return self._files[rel]

    def check_files(self, keys: Optional[set] = None) -> None:
        """Every file the metadata names (for `keys`, default all) exists and holds the byte ranges it lists."""
        need: dict = {}
        for index, info in self.metadata.storage_data.items():
            if keys is not None and index.fqn not in keys:
                continue
            end, names = need.get(info.relative_path, (0, set()))
            names.add(index.fqn)
            need[info.relative_path] = (max(end, info.offset + info.length), names)
        problems = []
        for rel, (end, names) in sorted(need.items()):
            path = self.dir / rel
            example = sorted(names)[:3]
            if not path.is_file():
                problems.append(f"{path}: missing; it holds chunks of {len(names)} tensors, e.g. {example}")
            elif path.stat().st_size < end:
                problems.append(f"{path}: truncated ({path.stat().st_size} bytes, the metadata lists data up to byte "
                                f"{end}); it holds chunks of {len(names)} tensors, e.g. {example}")
        if problems:
            raise CheckpointError(f"checkpoint {self.dir} is incomplete or corrupted ({len(problems)} files):\n  "
                                  + "\n  ".join(problems))

    def shape(self, key: str) -> tuple:
        return tuple(self.tensors[key].size)

    def dtype(self, key: str) -> torch.dtype:
        return self.tensors[key].properties.dtype

    def chunks(self, key: str) -> list:
        """The saved chunks of `key` with the location of their raw bytes (located once, on first use)."""
        if key not in self._chunks:
            from torch.distributed.checkpoint.metadata import MetadataIndex

            md = self.tensors[key]
            out = []
            for c in md.chunks:
                info = self.metadata.storage_data[MetadataIndex(key, c.offsets)]
                data = None
                if not info.transform_descriptors:
                    data = raw_data_offset(self._file(info.relative_path), info.offset, info.length,
                                           tuple(c.sizes), md.properties.dtype)
                out.append(_Chunk(tuple(c.offsets), tuple(c.sizes), info.relative_path, data))
            self._chunks[key] = out
        return self._chunks[key]

    def read(self, key: str, index: tuple = ()) -> torch.Tensor:
        """The global tensor `key`, or only `key[i0, i1, ...]` (leading dimensions: a stacked layer, an expert), from
        the saved chunks that overlap it, and of each only the overlapping bytes where it is stored raw."""
        shape = self.shape(key)
        k = len(index)
        offsets = tuple(index) + (0,) * (len(shape) - k)
        target = torch.empty((1,) * k + shape[k:], dtype=self.dtype(key))
        try:
            covered = self._read_raw(key, offsets, target)
            if covered is None:
                covered = self._read_with_torch(key, offsets, target)
        except CheckpointError:
            raise
        except Exception as exc:
            files = sorted({info.relative_path for i, info in self.metadata.storage_data.items() if i.fqn == key})
            raise CheckpointError(f"{key}: cannot be read from {self.dir} files {files} ({type(exc).__name__}: "
                                  f"{exc}); the checkpoint is corrupted") from exc
        if covered != target.numel():
            raise CheckpointError(f"{key}{list(index) if index else ''}: the checkpoint's chunks cover {covered} of "
                                  f"{target.numel()} elements (a rank's shards are missing)")
        return target.reshape(shape[k:])

    def _read_raw(self, key: str, offsets: tuple, target: torch.Tensor) -> Optional[int]:
        """Fill `target` (the box at `offsets` of tensor `key`) from the raw bytes of the saved chunks; the number of
        elements they covered, or None when a chunk is not stored raw (torch's reader reads it all then)."""
        chunks = self.chunks(key)
        if any(c.data_offset is None for c in chunks):
            return None
        sizes = tuple(target.shape)
        covered = 0
        for c in chunks:
            lo = [max(o, co) for o, co in zip(offsets, c.offsets)]
            hi = [min(o + s, co + cs) for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes)]
            if any(h <= lo_ for lo_, h in zip(lo, hi)):
                continue
            box = tuple(h - lo_ for lo_, h in zip(lo, hi))
            src = box_range(c.sizes, tuple(lo_ - co for lo_, co in zip(lo, c.offsets)), box)
            if src is None:  # not reached for slices of leading dims; kept exact for any other box
                return None
            dst = _narrow(target, [lo_ - o for lo_, o in zip(lo, offsets)], box)
            fd = self._file(c.path).fileno()
            byte = c.data_offset + src[0] * target.element_size()
            if dst.is_contiguous():
                pread_into(fd, dst, byte)
            else:  # TP split of a later dimension: each of the chunk's rows is read into its row of the result
                pread_rows_into(fd, dst, byte)
            covered += src[1]
        return covered

    def file_ranges(self, key: str, first: int, count: int) -> Optional[list]:
        """Where elements [first, first + count) of the row-major global tensor `key` lie in the shard files:
        [(fd, byte offset, nbytes)] in order, or None unless every chunk they touch is stored raw as one contiguous
        run of the global tensor (a row block: dim-0 splits)."""
        shape = self.shape(key)
        size = self.dtype(key).itemsize
        runs = []
        for c in self.chunks(key):
            run = box_range(shape, c.offsets, c.sizes)
            if run is None or c.data_offset is None:
                return None
            runs.append((run[0], run[1], c))
        out, at, end = [], first, first + count
        for start, n, c in sorted(runs, key=lambda r: r[0]):
            if start + n <= at or start >= end:
                continue
            if start > at:
                return None  # a gap: not covered
            stop = min(end, start + n)
            out.append((self._file(c.path).fileno(), c.data_offset + (at - start) * size, (stop - at) * size))
            at = stop
        return out if at == end else None

    def _read_with_torch(self, key: str, offsets: tuple, target: torch.Tensor) -> int:
        """Fill `target` (the box at `offsets` of tensor `key`) through torch.distributed.checkpoint's reader (it
        loads each overlapping chunk whole; any storage format); the number of elements the saved chunks covered."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self.tensors[key]
        items = create_read_items_for_chunk_list(key, md, [ChunkStorageMetadata(torch.Size(offsets), target.shape)])
        into = _Into(target)
        self.reader.read_data(LoadPlan(items), into).wait()
        return into.covered
