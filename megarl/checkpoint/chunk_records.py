"""Where a saved chunk's row-major bytes lie in a torch_dist shard file, and reading them straight into place.

torch_dist writes each chunk as a torch.save record (a zip archive, stored, not compressed: data.pkl describes the
tensor, data/<key> holds its storage) at the byte range the checkpoint's metadata lists. Parsing that record with a few
small reads finds the chunk's raw bytes; the merger then reads only the bytes of the slice it wants, into their place,
and copies tensors whose HF bytes are one contiguous run of raw chunks file to file. Through torch's own reader each
chunk is loaded whole by torch.load, through Python file callbacks, and copied again: the merge of
bench/bench_merge.py's checkpoint took 2.0x (the whole command) and 4.7x (merge() alone) as long that way (medians of
three runs alternating with this path, HISTORY.md's bench table). Anything not a plain contiguous little-endian tensor
record gives None here and is read through torch.distributed.checkpoint (megarl.checkpoint.dcp_reader).
"""
from __future__ import annotations

import io
import math
import os
import pickle
import re
import struct
from typing import Optional

import torch

_SAME_SIZE_INT = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_ROW_READ_BYTES = 64 << 10


def raw_data_offset(f, offset: int, length: int, chunk: tuple, dtype: torch.dtype) -> Optional[int]:
    """Where the row-major bytes of a chunk saved by torch.save (as torch_dist does) start in the file, or None when
    the record is anything else (another byte order, a view into a bigger storage, not contiguous, not a zip archive
    of the expected form): those chunks are read through torch.distributed.checkpoint instead.

    The record is a zip archive (stored, not compressed): its central directory, at the end, gives each member's place;
    data.pkl describes the tensor and data/<key> holds its storage. Parsed here with a few small reads (a checkpoint
    has a record per chunk, and torch.load would read each through Python file callbacks)."""
    fd = f.fileno()
    members = _zip_members(fd, offset, length)
    if members is None:
        return None
    pkl, data, order = ([m for name, m in members.items() if re.search(pattern, name)]
                        for pattern in (r"(^|/)data\.pkl$", r"(^|/)data/[^/]+$", r"(^|/)byteorder$"))
    if len(pkl) != 1 or len(data) != 1 or (order and _member_bytes(fd, offset, order[0]) != b"little"):
        return None
    header = _tensor_header(_member_bytes(fd, offset, pkl[0]) or b"")
    if header is None:
        return None
    saved_dtype, storage_numel, storage_offset, size, stride = header
    numel = math.prod(chunk)
    contiguous = all(s == math.prod(size[d + 1:]) for d, s in enumerate(stride) if size[d] != 1)
    if not (size == tuple(chunk) and saved_dtype == dtype and contiguous and storage_offset == 0
            and storage_numel == numel and data[0][2] == numel * dtype.itemsize):
        return None
    start = _member_start(fd, offset, data[0])
    return None if start is None else offset + start


def _zip_members(fd: int, offset: int, length: int) -> Optional[dict]:
    """{name: (name, local header offset, size)} of the stored (uncompressed) members of the zip archive at
    [offset, offset + length) of the file, from its central directory; None if it is not such an archive (or has a
    member over 4 GiB). Not zipfile: it needs a file object for the record's window, and torch's window
    (`_create_file_view`) seeks wrongly from the end, which is where zipfile starts."""
    tail_len = min(length, 1 << 16)
    tail = os.pread(fd, tail_len, offset + length - tail_len)
    end = tail.rfind(b"PK\x05\x06")
    if end < 0 or len(tail) < end + 22:
        return None
    count, cd_size, cd_at = struct.unpack_from("<HII", tail, end + 10)
    loc = tail.rfind(b"PK\x06\x07", 0, end)
    if loc >= 0:  # zip64 (torch writes it always): the 64-bit end record, found through its locator
        (z64_at,) = struct.unpack_from("<Q", tail, loc + 8)
        z64 = os.pread(fd, 56, offset + z64_at)
        if len(z64) < 56 or z64[:4] != b"PK\x06\x06":
            return None
        count, cd_size, cd_at = struct.unpack_from("<QQQ", z64, 32)
    cd = os.pread(fd, cd_size, offset + cd_at)
    if len(cd) != cd_size:
        return None
    members, at = {}, 0
    for _ in range(count):
        if cd[at:at + 4] != b"PK\x01\x02" or len(cd) < at + 46:
            return None
        method, csize, usize, nlen, elen, clen = struct.unpack_from("<H8xIIHHH", cd, at + 10)
        (local,) = struct.unpack_from("<I", cd, at + 42)
        name = cd[at + 46: at + 46 + nlen].decode("utf-8", "replace")
        if 0xFFFFFFFF in (usize, csize, local):  # a member over 4 GiB (zip64 extra field): left to torch's reader
            return None
        if method != 0 or csize != usize:  # compressed: not raw bytes
            return None
        members[name] = (name, local, csize)
        at += 46 + nlen + elen + clen
    return members


def _member_start(fd: int, offset: int, member: tuple) -> Optional[int]:
    """Offset, within the archive, of a member's data: after its local header (whose extra field, used by torch for
    alignment, may differ from the central directory's); None if the header is not there."""
    local = os.pread(fd, 30, offset + member[1])
    if len(local) < 30 or local[:4] != b"PK\x03\x04":
        return None
    nlen, elen = struct.unpack_from("<HH", local, 26)
    return member[1] + 30 + nlen + elen


def _member_bytes(fd: int, offset: int, member: tuple) -> Optional[bytes]:
    start = _member_start(fd, offset, member)
    return None if start is None else os.pread(fd, member[2], offset + start)


_STORAGE_DTYPES = {"FloatStorage": torch.float32, "BFloat16Storage": torch.bfloat16, "HalfStorage": torch.float16,
                   "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
                   "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
                   "BoolStorage": torch.bool}


class _TensorHeaderUnpickler(pickle.Unpickler):
    """Reads the data.pkl of torch.save(tensor) with only the names the pickle of a plain tensor uses, resolved to
    stubs: nothing is imported or called."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, storage_offset, size, stride, *rest: (storage, storage_offset, size, stride)
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):  # ("storage", storage type, key, location, numel)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and isinstance(pid[1], torch.dtype)):
            raise pickle.UnpicklingError(f"storage {pid!r}")
        return pid[1], int(pid[4])


def _tensor_header(pkl: bytes) -> Optional[tuple]:
    """(dtype, storage numel, storage offset, size, stride) from the data.pkl of torch.save(tensor), or None when it
    holds anything else."""
    try:
        result = _TensorHeaderUnpickler(io.BytesIO(pkl)).load()
        (dtype, storage_numel), storage_offset, size, stride = result
        return dtype, storage_numel, int(storage_offset), tuple(size), tuple(stride)
    except Exception:  # noqa: BLE001 - not a plain tensor record: the caller falls back to torch's reader
        return None


def box_range(shape: tuple, start: tuple, size: tuple) -> Optional[tuple]:
    """(first element, count) of box [start, start + size) of a row-major array of `shape` when the box is one
    contiguous run of elements, else None."""
    d = 0
    while d < len(shape) and size[d] == 1:  # leading dims of extent 1
        d += 1
    if any(size[k] != shape[k] for k in range(d + 1, len(shape))):  # after the first wider dim: whole dims only
        return None
    first, stride = 0, 1
    for k in reversed(range(len(shape))):
        first += start[k] * stride
        stride *= shape[k]
    return first, math.prod(size)


def pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill the contiguous tensor `out` with the file's bytes at `offset` (one kernel copy, no intermediate)."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"short read at byte {offset + done}")
        done += n


def pread_rows_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill `out`, a view whose last dim is contiguous (a column block of a bigger tensor), with the file's
    row-major bytes at `offset`: rows of 64 KiB and more in one scatter read per 1024 rows, no intermediate buffer;
    shorter rows are read in one piece and then placed (one memory copy costs less than a Python object per row)."""
    rows = out.view(-1, out.shape[-1]) if out.stride(-1) == 1 else None
    if rows is None or rows.shape[1] * rows.element_size() < _ROW_READ_BYTES:  # read, then place
        part = torch.empty(out.shape, dtype=out.dtype)
        pread_into(fd, part, offset)
        out.copy_(part)
        return
    flat = rows.view(torch.uint8) if rows.element_size() == 1 else rows.view(_SAME_SIZE_INT[rows.element_size()])
    arrays = flat.numpy()
    row_bytes = rows.shape[1] * rows.element_size()
    for start in range(0, rows.shape[0], 1024):  # IOV_MAX
        views = [memoryview(a) for a in arrays[start:start + 1024]]
        want = len(views) * row_bytes
        if os.preadv(fd, views, offset + start * row_bytes) != want:  # a short read: rare, redo it row by row
            for i in range(start, start + len(views)):
                pread_into(fd, rows[i], offset + i * row_bytes)
