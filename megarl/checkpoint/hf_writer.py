"""Write a Hugging Face model directory from the bridge's export stream, one safetensors shard per bucket.

The directory is written aside (`<out>.tmp`) and renamed when complete, so a crash never leaves a half-written model
where a later run would load it. Non-weight files (config.json, generation_config.json, tokenizer files, chat
template) are copied from the source HF directory.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "tokenizer.model",
                   # a vision-language model's processor (AutoProcessor reads them beside the tokenizer)
                   "preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
_COPIED = ("config.json", "generation_config.json", *TOKENIZER_FILES)


def copy_files(source_dir: str | Path, out_dir: str | Path, names: Sequence[str] = _COPIED) -> None:
    """Copy those of `names` that `source_dir` has into `out_dir`, verbatim."""
    for fname in names:
        if (Path(source_dir) / fname).exists():
            shutil.copy2(Path(source_dir) / fname, Path(out_dir) / fname)


def write_hf_model(buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], source_dir: str | Path,
                   out_dir: str | Path) -> Path:
    """Consume `buckets` of (hf_name, tensor) and write `out_dir` (index + shards + copied config/tokenizer)."""
    from safetensors.torch import save_file

    out, tmp = Path(out_dir), Path(str(out_dir) + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shards: list[tuple[str, list[str]]] = []
    total = 0
    for i, bucket in enumerate(buckets):
        name = f"model-{i + 1:05d}.safetensors"
        tensors = {n: t.detach().contiguous().cpu() for n, t in bucket}
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        shards.append((name, list(tensors)))
    count = len(shards)
    weight_map = {}
    for i, (name, names) in enumerate(shards):  # rename to the conventional model-0000i-of-0000n pattern
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        (tmp / name).rename(tmp / final)
        weight_map.update({n: final for n in names})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    copy_files(source_dir, tmp)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Streaming writer: shards planned from names/shapes/dtypes up front, tensors written one at a time
# ---------------------------------------------------------------------------------------------------------------------

_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
              torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class FileBytes:
    """A tensor given as where its row-major bytes already lie in files: ranges [(fd, offset, nbytes)], in order.
    The writer copies them file to file (sendfile: inside the kernel, never through this process's memory)."""

    shape: tuple
    dtype: torch.dtype
    ranges: tuple

    @property
    def nbytes(self) -> int:
        return sum(n for _, _, n in self.ranges)


def _write_all(fd: int, data) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        view = view[os.write(fd, view):]


def _copy_ranges(fd: int, ranges) -> None:
    """Append the bytes of `ranges` to the file `fd` (at its position): sendfile, a copy inside the kernel (on ext4
    several times faster than copy_file_range and than a read and a write), else read and write in 64 MiB pieces."""
    for src, offset, nbytes in ranges:
        while nbytes:
            try:
                n = os.sendfile(fd, src, offset, min(nbytes, 1 << 30))
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                n = 0
            if n <= 0:  # no in-kernel copy between these files: through a buffer
                piece = os.pread(src, min(nbytes, 64 << 20), offset)
                if not piece:
                    raise OSError(f"short read at byte {offset} of a source file")
                _write_all(fd, piece)
                n = len(piece)
            offset += n
            nbytes -= n


def parse_size(size) -> int:
    """Bytes from an int or a string like "5GB", "500MB", "200KB" (decimal units, as transformers uses)."""
    if isinstance(size, int):
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GIB", 1 << 30), ("MIB", 1 << 20), ("KIB", 1 << 10), ("GB", 10 ** 9), ("MB", 10 ** 6),
                       ("KB", 10 ** 3), ("B", 1)):
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * mult)
    return int(text)


class StreamingHFWriter:
    """Write sharded safetensors tensor by tensor; memory is one tensor, never one shard.

        w = StreamingHFWriter(out_dir, [(name, shape, dtype), ...], max_shard_bytes=5 * 10**9)
        for name, tensor in stream: w.write(name, tensor)          # in the planned order
        w.finish(source_dir, config=...)                           # checks, index, copies, rename

    The planned tensors are laid out in shards up front (a new shard starts before one would exceed
    max_shard_bytes; a bigger tensor gets a shard of its own), so every shard's safetensors header is written first
    and the data streams after it. `finish` refuses to write the index unless every planned tensor was written exactly
    once with its planned shape and dtype. Everything goes to `<out>.tmp`, renamed to `<out>` at the end.

    A tensor may also be given as FileBytes (where its bytes already lie in other files): copied file to file.

    pending_bytes > 0: the file writes happen in a background thread, so the caller reads and converts the next
    tensors while earlier ones are written; `write` returns once the tensor is queued, and at most pending_bytes of
    queued tensors are held (one tensor always fits). The caller must not change a tensor after passing it to `write`.
    `wait_for_room(n)` blocks until n more bytes fit, for callers that want to bound memory before building a tensor.
    """

    def __init__(self, out_dir, plan: Sequence[tuple], max_shard_bytes: int = 5 * 10 ** 9, on_bytes=None,
                 pending_bytes: int = 0):
        self.out, self.tmp = Path(out_dir), Path(str(out_dir) + ".tmp")
        self.on_bytes = on_bytes
        self.pending_bytes = pending_bytes
        self._queue: deque = deque()
        self._pending = 0  # bytes queued or being written
        self._error: Optional[BaseException] = None
        self._cond = threading.Condition()
        self._thread: Optional[threading.Thread] = None
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        shards, current, size = [], [], 0
        for name, shape, dtype in plan:
            nbytes = _numel(shape) * torch.tensor([], dtype=dtype).element_size()
            if current and size + nbytes > max_shard_bytes:
                shards.append(current)
                current, size = [], 0
            current.append((name, tuple(shape), dtype, nbytes))
            size += nbytes
        if current:
            shards.append(current)
        self.files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        self.order = [(self.files[i], item) for i, shard in enumerate(shards) for item in shard]
        self.shards = shards
        self.total = sum(item[3] for _, item in self.order)
        self.position = 0
        self.written: dict = {}
        self._file, self._fh = None, None

    def _open(self, fname: str, shard: list) -> None:
        if self._fh is not None:
            self._fh.close()
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, shape, dtype, nbytes in shard:
            header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        self._fh = open(self.tmp / fname, "wb", buffering=0)  # unbuffered: sendfile appends at its position
        _write_all(self._fh.fileno(), len(raw).to_bytes(8, "little") + raw)
        self._file = fname

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self.position >= len(self.order):
            raise ValueError(f"{name}: more tensors than planned ({len(self.order)})")
        fname, (want, shape, dtype, nbytes) = self.order[self.position]
        if name != want:
            raise ValueError(f"{name}: written out of order; the plan expects {want} next")
        if tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} {tensor.dtype}, planned {shape} {dtype}")
        if name in self.written:
            raise ValueError(f"{name}: written twice")
        if isinstance(tensor, FileBytes):
            if tensor.nbytes != nbytes:
                raise ValueError(f"{name}: {tensor.nbytes} bytes in its file ranges, planned {nbytes}")
            data, held = tensor, 0  # holds no memory while it waits
        else:
            data, held = tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy(), nbytes
        self.written[name] = fname
        self.position += 1
        if not self.pending_bytes:
            self._emit(fname, data, nbytes)
            return
        self.wait_for_room(held)
        with self._cond:
            self._queue.append((fname, data, nbytes, held))
            self._pending += held
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._drain_queue, name="hf-writer", daemon=True)
            self._thread.start()

    def wait_for_room(self, nbytes: int) -> None:
        """Block until `nbytes` more fit in pending_bytes (or nothing is pending); re-raise a failed write."""
        with self._cond:
            self._cond.wait_for(lambda: self._error is not None or not self._pending
                                or self._pending + nbytes <= self.pending_bytes)
            if self._error is not None:
                raise self._error

    def _emit(self, fname: str, data, nbytes: int, held: int = 0) -> None:
        if fname != self._file:
            self._open(fname, self.shards[self.files.index(fname)])
        if isinstance(data, FileBytes):
            _copy_ranges(self._fh.fileno(), data.ranges)
        else:
            _write_all(self._fh.fileno(), data)
        if self.on_bytes is not None:
            self.on_bytes(nbytes)

    def _drain_queue(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue)
                item = self._queue.popleft()
                if item is None:
                    return
            try:
                self._emit(*item)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                with self._cond:
                    self._error = exc
                    self._queue.clear()
                    self._pending = 0
                    self._cond.notify_all()
                return
            with self._cond:
                self._pending = max(0, self._pending - item[3])  # abort() may have zeroed it meanwhile
                self._cond.notify_all()

    def _join(self) -> None:
        """Wait for the queued writes; re-raise the first failure."""
        if self._thread is not None:
            with self._cond:
                self._queue.append(None)
                self._cond.notify_all()
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise self._error

    def abort(self) -> None:
        with self._cond:  # drop what is queued; a write in progress finishes
            self._queue.clear()
            self._pending = 0
        try:
            self._join()
        except BaseException:  # noqa: BLE001 - aborting anyway
            pass
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        shutil.rmtree(self.tmp, ignore_errors=True)

    def finish(self, source_dir=None, config: Optional[dict] = None, extra_files: Optional[dict] = None) -> Path:
        """Check completeness, write the index and the non-weight files, rename `<out>.tmp` to `<out>`.

        config: written as config.json instead of copying the source's; extra_files: {name: text} written as well."""
        try:
            self._join()
        except BaseException:
            self.abort()
            raise
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        missing = [item[0] for _, item in self.order if item[0] not in self.written]
        if missing:
            self.abort()
            raise ValueError(f"{len(missing)} planned tensors were never written: {missing[:8]}")
        for fname, shard in zip(self.files, self.shards):  # every file has exactly its header + data bytes
            path = self.tmp / fname
            with open(path, "rb") as f:
                hlen = int.from_bytes(f.read(8), "little")
            expected = 8 + hlen + sum(item[3] for item in shard)
            if path.stat().st_size != expected:
                self.abort()
                raise ValueError(f"{fname}: {path.stat().st_size} bytes written, expected {expected}")
        index = {"metadata": {"total_size": self.total},
                 "weight_map": {name: fname for fname, (name, *_rest) in self.order}}
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        (self.tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if source_dir is not None:
            for fname in _COPIED:
                if fname == "config.json" and config is not None:
                    continue
                if (Path(source_dir) / fname).exists():
                    shutil.copy2(Path(source_dir) / fname, self.tmp / fname)
        if config is not None:
            (self.tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        for fname, text in (extra_files or {}).items():
            (self.tmp / fname).write_text(text)
        if self.out.exists():
            shutil.rmtree(self.out)
        self.tmp.rename(self.out)
        return self.out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
