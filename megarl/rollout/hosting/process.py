"""Run a VLLMEngine (or the transformers engine, rollout.name=hf) in a child process of the trainer's rank 0, behind
the same methods.

Why: vLLM's in-process engine initialises torch.distributed. Inside a trainer rank the default process group already
spans the trainer's world, and vLLM would build its groups on it, a collective the other ranks never join (a hang).
The child starts without the torchrun variables, so vLLM sees a world of its own. On GPU it also starts with
CUDA_VISIBLE_DEVICES naming its replica's GPUs only (megarl.layout.engine_devices): vLLM's workers and the HF engine
take devices 0 .. TP-1, which would otherwise be the node's first GPUs for every replica.

Large tensors cross the pipe through torch.multiprocessing's pickler, i.e. in shared memory, not as copies of bytes;
small ones (a rollout batch of short responses) as bytes in the message, which costs a tenth of setting up a
shared-memory segment and passing its file.

Every call carries an id that its reply repeats, so a reply can never be taken for another call's. Weights do not
cross the pipe: the trainer ranks write each engine worker's shard into shared-memory bucket files and the call
names the files (megarl.sync.transports.colocated).
"""
from __future__ import annotations

import contextlib
import os
import pickle
import queue
import sys
import threading
import time
import traceback
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Sequence

import torch
import torch.multiprocessing as mp

from megarl import lifecycle
from megarl.config.schema import RolloutConfig
from megarl.layout import EngineDevices
from megarl.rollout.health import EngineHealth, HealthSettings
from megarl.rollout.protocol import Deferred
from megarl.rollout.requests import AbortSignal
from megarl.rollout.threads import apply_engine_threads, available_cores
from megarl.console import LOG_DIR_ENV, capture_engine_output, log_tail

# torchrun / launch_local variables that would make vLLM join the trainer's process group
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def child_environment(parent: Mapping[str, str], devices: Optional[Sequence[str]] = None) -> dict:
    """The engine process's environment: the trainer rank's, without the torchrun variables (vLLM would join the
    trainer's process group), and where `devices` are given (GPU runs) with CUDA_VISIBLE_DEVICES naming exactly them."""
    env = {k: v for k, v in parent.items() if k not in _DIST_VARS}
    if devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    return env


def engine_gpus(devices: Optional[EngineDevices]) -> Optional[tuple]:
    """The GPUs an engine child is given to see (CUDA_VISIBLE_DEVICES); None: what the rank sees. A CPU replica
    (EngineDevices.on_cpu) has none: its devices only name its node in the start line."""
    return devices.devices if devices is not None and devices.num_gpus else None


@contextlib.contextmanager
def _environment(env: Mapping[str, str]):
    """os.environ is `env` while the block runs (a spawned child takes it), then what it was."""
    saved = dict(os.environ)
    for key in set(saved) - set(env):
        del os.environ[key]
    os.environ.update(env)
    try:
        yield
    finally:
        for key in set(os.environ) - set(saved):
            del os.environ[key]
        os.environ.update(saved)


class EngineProcessError(RuntimeError):
    """The engine child process failed: a start failure in one line (the cause, the fix where known, the engine's log);
    a failed call with the engine process's traceback."""


class EngineDied(EngineProcessError):
    """The engine is lost and a restart can cure it (megarl.rollout.hosting.supervisor): its process is gone (killed,
    crashed), hung or stopped (megarl.rollout.health), or a call failed inside the engine with an error of the engine's
    own state (`EngineCrashed`). A failed call's other errors (a bad request, a configuration) are not cured that way."""


class EngineCrashed(EngineDied):
    """A call failed inside the engine with an error a fresh engine does not have: an OOM in the engine (its KV cache,
    a CUDA allocation), a dead TP worker, a CUDA or NCCL error."""


# what a failed call's error says when the engine's own state broke (a restart cures it); anything else (a value or
# type error, a refused request) is the caller's and ends the run as before
_CURABLE_TYPES = ("OutOfMemoryError", "EngineDeadError", "AcceleratorError", "CudaError", "NcclError")
_CURABLE_TEXT = ("CUDA out of memory", "CUDA error", "NCCL error", "CUBLAS_STATUS", "cuDNN error", "illegal memory access",
                 "Worker proc", "worker died", "died unexpectedly", "EngineCore encountered", "RPC call to")


def curable(exc: BaseException) -> bool:
    """Whether a call's error inside the engine (with its causes) is one a restarted engine would not have."""
    seen = exc
    while seen is not None:
        if type(seen).__name__ in _CURABLE_TYPES or any(t in str(seen) for t in _CURABLE_TEXT):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class EngineStartFailed(EngineProcessError, lifecycle.Explained):
    """The engine process could not start; the message is one line (the cause, the fix where known, the engine's
    log)."""


def _serve(conn, config: RolloutConfig, model_path: str, seed: int, prompt_overflow: str, parent: int,
           cores: Optional[Sequence[int]] = None, abort_counter=None, lora: Optional[dict] = None,
           cpu=None, where: str = "", health: Optional[EngineHealth] = None) -> None:
    # A scheduler's SIGTERM (or a terminal's SIGINT) to the whole process tree must not kill the engine mid-step: the
    # trainer finishes the step, saves, and shuts the engine down itself. If the trainer dies, even by SIGKILL, the
    # kernel kills this process (parent-death signal); if it only closes the pipe, this loop ends.
    lifecycle.bind_to_parent(parent)
    capture_engine_output()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        apply_engine_threads(cores or available_cores(), config.tensor_model_parallel_size)  # the trainer idles meanwhile
        if config.name == "hf":
            from megarl.rollout.hf.engine import HFEngine as Engine
        else:
            from megarl.rollout.vllm.engine import VLLMEngine as Engine

        engine = Engine(config, model_path, seed=seed, prompt_overflow=prompt_overflow,
                        abort_signal=AbortSignal(abort_counter), lora=lora, cpu=cpu, where=where,
                        progress=health.progress if health is not None else None)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send((0, "error", start_failure_line(exc, _output_file())))
        return
    if health is not None:
        health.start_beating()
    conn.send((0, "ready", None))
    calls = _receive_continuously(conn)
    while True:
        item = calls.get()
        if item is None:  # the trainer is gone
            engine.shutdown()
            return
        call_id, method, args, kwargs = item
        if method == "shutdown":
            engine.shutdown()
            conn.send((call_id, "ok", None))
            return
        if health is not None:
            health.busy(method)
        try:
            value = getattr(engine, method)
            reply = _ReplyPickler.dumps((call_id, "ok", value(*args, **kwargs) if callable(value) else value),
                                        pickle.HIGHEST_PROTOCOL)
        except BaseException as exc:  # noqa: BLE001
            status = "lost" if curable(exc) else "error"
            reply = _ReplyPickler.dumps((call_id, status, _describe(exc)), pickle.HIGHEST_PROTOCOL)
        if health is not None:
            health.idle()
        conn.send_bytes(reply)


_BY_VALUE_BYTES = 1 << 20  # tensors up to this size travel inside the message


def _tensor_from_bytes(data: bytes, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


class _ReplyPickler(ForkingPickler):
    """torch.multiprocessing's pickler (tensors in shared memory), except for small CPU tensors: by value."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.requires_grad \
                and obj.numel() * obj.element_size() <= _BY_VALUE_BYTES:
            data = obj.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            return _tensor_from_bytes, (data, obj.dtype, tuple(obj.shape))
        return NotImplemented


def _receive_continuously(conn) -> "queue.Queue":
    """The calls from the trainer, read by a thread as they arrive: the trainer may queue several (generations of
    the batches ahead of it) while one runs, and its sends must never wait for the engine, or a large call and a large
    reply could block each other on the pipe. None after the pipe closes."""
    calls: queue.Queue = queue.Queue()

    def read():
        while True:
            try:
                calls.put(conn.recv())
            except (EOFError, OSError):
                calls.put(None)
                return

    threading.Thread(target=read, name="engine-calls", daemon=True).start()
    return calls


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n--- engine process traceback ---\n{traceback.format_exc()}"


def _output_file() -> Optional[str]:
    """The file this process's output goes to: its log under the job's log directory (megarl.console), else the file
    its stderr was opened on (a launched rank's log); None for a terminal or a pipe."""
    directory = os.environ.get(LOG_DIR_ENV)
    if directory:
        return str(Path(directory) / f"{mp.current_process().name.removeprefix('megarl-')}.log")
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:  # not Linux, or no such link
        return None
    return target if os.path.isfile(target) else None


def start_failure_line(exc: BaseException, log_file: Optional[str]) -> str:
    """One line for the console about an engine that failed to start, naming its log for the rest. A known cause
    (EngineStartError: the cause and the fix) leaves its traceback only in the log; any other error prints its
    traceback into this process's output (the log, or the terminal where there is none)."""
    from megarl.rollout.protocol import EngineStartError
    from megarl.rollout.start_errors import describe_exception, one_line

    known = isinstance(exc, EngineStartError)
    if log_file is not None or not known:
        traceback.print_exc()
        sys.stderr.flush()
    line = one_line(str(exc), limit=2000) if known else \
        f"rollout engine failed to start: {describe_exception(exc)} {lifecycle.see('engine-start')}"
    if log_file is not None:
        return f"{line} (the engine's log, with vLLM's messages and the traceback: {log_file})"
    return line if known else f"{line} (its traceback is above)"


class EngineProcess:
    """A VLLMEngine (or, with rollout.name=hf, an HFEngine) living in a child process; the same methods."""

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 start_timeout_s: float = 600, cores: Optional[Sequence[int]] = None,
                 name: str = "megarl-vllm-engine", lora: Optional[dict] = None, cpu=None,
                 reply_timeout_s: Optional[float] = None, devices: Optional[EngineDevices] = None):
        """cpu: the CPU the engine's kernels are chosen for (megarl.rollout.vllm.cpu_engine.CpuInfo; None: this
        machine's). reply_timeout_s: a call with no reply for that long means a hung engine (EngineDied).
        devices: the replica's node and GPUs (GPU runs): the engine sees only those, and its start line names them;
        None: the GPUs this process sees."""
        self.model_path = str(model_path)
        self._feed = None  # megarl.sync.transports.feed, made by the first update_weights
        self.reply_timeout_s = reply_timeout_s
        self._config = config
        self._calls = 0
        self._waiting: dict[int, str] = {}  # call id -> method, of the calls sent and not yet answered
        self._replies: dict[int, tuple] = {}  # replies that arrived before their handle asked for them
        self._layouts = None
        ctx = mp.get_context("spawn")
        settings = HealthSettings.of(config)
        self._health = EngineHealth(ctx, settings) if settings is not None else None
        self._conn, child = ctx.Pipe()
        # abort() must reach a generate that is running, while the child is not reading the pipe: a shared counter
        self._abort = AbortSignal(ctx.Value("q", 0))
        with _environment(child_environment(os.environ, engine_gpus(devices))):
            self._proc = ctx.Process(target=_serve, args=(child, config, str(model_path), seed, prompt_overflow,
                                                          os.getpid(), cores, self._abort.shared, lora, cpu,
                                                          devices.describe() if devices is not None else "",
                                                          self._health),
                                     # vLLM's workers (engine TP > 1) are children of this process: a daemonic
                                     # process may not have any; the engine dies with the trainer either way
                                     daemon=config.tensor_model_parallel_size == 1, name=name)
            self._proc.start()
            lifecycle.kill_at_exit(self._proc)
        child.close()
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise EngineStartFailed(f"the vLLM engine did not start within {start_timeout_s:.0f} s; its log: "
                                    f"{self._proc.name.removeprefix('megarl-')} "
                                    f"{lifecycle.see('engine-start-timeout')}")
        _, status, payload = self._recv()
        if status == "error":  # one line: the cause, the fix where known, and the engine's log
            self._proc.join(timeout=10)
            raise EngineStartFailed(payload)

    @property
    def pid(self) -> Optional[int]:
        return self._proc.pid

    def _recv(self):
        """The next reply; while it does not come, the watchdog (megarl.rollout.health) and rollout.engine_timeout_s
        are consulted every moment, and a lost engine raises EngineDied."""
        timeout = self.reply_timeout_s
        start = time.monotonic()
        look = min(1.0, self._health.settings.interval_s) if self._health is not None else 1.0
        while not self._conn.poll(look):
            if timeout is not None and time.monotonic() - start > timeout:
                raise EngineDied(f"the engine process gave no reply for {timeout:.0f} s (rollout.engine_timeout_s): "
                                 f"hung or stopped")
            self.check_health()
        try:
            return self._conn.recv()
        except (EOFError, ConnectionResetError):  # the engine is gone (a reset when it died mid-reply)
            raise self._died() from None

    def check_health(self) -> None:
        """Raise EngineDied if the engine process is gone, stopped or hung (megarl.rollout.health); also asked before
        new work is handed to an idle engine (the watchdog's ping)."""
        if not self._proc.is_alive():
            raise self._died()
        cause = self._health.check() if self._health is not None else None
        if cause is not None:
            raise EngineDied(cause)

    def _died(self) -> "EngineDied":
        self._proc.join(timeout=1)  # for its exit code
        return EngineDied(f"the vLLM engine process died (exit code {self._proc.exitcode}); "
                         f"{log_tail(self._proc.name.removeprefix('megarl-')) or 'see its log above for the reason'}")

    def inject_fault(self, kind: str) -> None:
        """Test hook (megarl.rollout.hosting.supervisor): the engine's next step raises an OOM ("oom") or hangs."""
        if self._health is None:
            raise RuntimeError("engine faults are injected through the watchdog: rollout.health.enable=false")
        self._health.inject(kind)

    def _send(self, obj) -> None:
        try:
            self._conn.send(obj)
        except (BrokenPipeError, ConnectionResetError):
            self._recv()  # the engine is gone: EOF, raised as EngineProcessError with its exit code
            raise

    def _submit(self, method: str, *args, **kwargs) -> int:
        """Send a call without waiting for its reply; the child runs the calls in the order they were sent."""
        self._calls += 1
        self._send((self._calls, method, args, kwargs))
        self._waiting[self._calls] = method
        return self._calls

    def _wait(self, call_id: int) -> Any:
        """The reply to call `call_id`. Replies to other calls still awaited that arrive first are kept for their own
        handles; a reply to a call nobody awaits means the channel is out of step."""
        while call_id not in self._replies:
            got, status, payload = self._recv()
            if got not in self._waiting:
                raise EngineProcessError(f"the engine answered call {got}, which nothing awaits, while call {call_id} "
                                         f"({self._waiting.get(call_id)}) was waiting: the engine channel is out of step")
            self._replies[got] = (status, payload)
        del self._waiting[call_id]
        status, payload = self._replies.pop(call_id)
        if status == "lost":
            raise EngineCrashed(f"the engine failed in a way a restart cures: {payload.splitlines()[0]}\n{payload}")
        if status == "error":
            raise EngineProcessError(payload)
        return payload

    def _call(self, method: str, *args, **kwargs) -> Any:
        return self._wait(self._submit(method, *args, **kwargs))

    def _deferred(self, call_id: int) -> Deferred:
        """The handle of a call sent and not yet waited for (start_generate and the like)."""
        return Deferred(lambda: self._wait(call_id))

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs):
        return self.start_generate(prompt_token_ids, **kwargs).result()

    def start_generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs) -> Deferred:
        """As generate, without waiting: the engine process generates while this process goes on (trains);
        `.result()` waits for the RolloutBatch. Calls made meanwhile run after it, in order."""
        return self._deferred(self._submit("generate", [list(p) for p in prompt_token_ids], **kwargs))

    def continue_generate(self, *args, **kwargs):
        return self.start_continue(*args, **kwargs).result()

    def start_continue(self, prompt_token_ids, partial_ids, prompt_index, seeds) -> Deferred:
        """VLLMEngine.continue_generate without waiting (as start_generate)."""
        return self._deferred(self._submit("continue_generate", [list(p) for p in prompt_token_ids],
                                              [list(r) for r in partial_ids], list(prompt_index), list(seeds)))

    def rollout_agents(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs):
        return self._call("rollout_agents", [list(p) for p in prompt_token_ids], **kwargs)

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        return self._call("sequence_logprobs", [list(t) for t in token_ids])

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False) -> dict:
        from megarl.sync.transports.feed import FullTensorFeed

        if self._feed is None:  # its slot files are kept from one feed to the next
            self._feed = FullTensorFeed(self.model_path)
        return self._feed.run(self, buckets, verify=verify)

    def begin_update(self, verify: bool = False) -> None:
        self._call("begin_update", verify=verify)

    def load_bucket(self, metas) -> None:
        self._call("load_bucket", metas)

    def place_weights(self, needs, prefix: str) -> list:
        return self._call("place_weights", needs, prefix)

    def end_update(self, placed=None) -> dict:
        return self._call("end_update", placed)

    def abort_update(self) -> None:
        self._call("abort_update")

    def load_adapter(self, meta: dict, verify: bool = False) -> dict:
        """VLLMEngine.load_adapter (actor.lora.sync: adapter): the file name and metadata cross the pipe."""
        return self._call("load_adapter", meta, verify=verify)

    # -- weights over a transfer group (rollout.placement=separate: megarl.sync.transports.remote), one engine host ----
    def transfer_layouts(self) -> list:
        return [self.layouts]

    def start_join_transfer(self, spec, first_rank: int) -> Deferred:
        return self._deferred(self._submit("join_transfer", spec, first_rank))

    def set_receive_plans(self, plans: list) -> None:
        self._call("set_receive_plan", plans[0])

    def leave_transfer(self) -> None:
        self._call("leave_transfer")

    def start_receive_weights(self, sync: int, verify: bool = False):
        call = self._deferred(self._submit("receive_weights", sync, verify=verify))
        return Deferred(lambda: [call.result()])

    @property
    def layouts(self) -> list:
        if self._layouts is None:
            self._layouts = self._call("layouts")
        return self._layouts

    @property
    def weight_version(self) -> int:
        return self._call("weight_version")

    def set_weight_version(self, version: int) -> None:
        self._call("set_weight_version", version)

    @property
    def events(self) -> list:
        return self._call("events")

    @property
    def sleeps(self) -> bool:
        """As VLLMEngine.sleeps, from the config (asked every step: no round trip)."""
        return bool(self._config.enable_sleep_mode and self._config.free_cache_engine)

    def checksums(self):
        return self._call("checksums")

    def expected_checksums(self, hf_checksums):
        return self._call("expected_checksums", hf_checksums)

    def verify_weights(self, expected, rtol: float = 1e-9):
        return self._call("verify_weights", expected, rtol=rtol)

    def sleep(self, level: int = 2) -> None:
        self._call("sleep", level)

    def wake_up(self, tags=None) -> None:
        self._call("wake_up", tags)

    def abort(self) -> None:
        """End the requests of the engine's running generate (if any): it returns what each sample generated so far,
        finish_reason 'abort'. Needs no reply from the busy engine (a counter in shared memory)."""
        self._abort.raise_()

    def shutdown(self, timeout_s: float = 30) -> None:
        if self._proc.is_alive():
            try:
                self._call("shutdown")
            except (EngineProcessError, BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=timeout_s)
        if self._proc.is_alive():
            lifecycle.kill_tree(self._proc.pid)

    def __del__(self):  # best effort: never leave an engine behind
        proc: Optional[Any] = getattr(self, "_proc", None)
        if proc is not None and proc.is_alive():
            proc.kill()
