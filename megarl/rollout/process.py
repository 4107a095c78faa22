"""Run a VLLMEngine in a child process of the trainer's rank 0, behind the same methods.

Why: vLLM's in-process engine initialises torch.distributed. Inside a trainer rank the default process group already
spans the trainer's world, and vLLM would build its groups on it, a collective the other ranks never join (a hang).
The child starts without the torchrun variables, so vLLM sees a world of its own. Tensors cross the pipe through
torch.multiprocessing's pickler, i.e. in shared memory, not as copies of bytes.

Weight sync streams: the parent sends buckets one at a time while the child feeds them into one vLLM
`reload_weights` pass (see VLLMEngine.update_weights), so neither side holds more than a bucket or two.
"""
from __future__ import annotations

import os
import signal
import traceback
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.multiprocessing as mp

from megarl.config.schema import RolloutConfig
from megarl.console import capture_engine_output, log_tail

# torchrun / launch_local variables that would make vLLM join the trainer's process group
_DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "ROLE_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")
_END = "__end_of_buckets__"


class EngineProcessError(RuntimeError):
    """The engine child process failed; the message carries its traceback."""


def _serve(conn, config: RolloutConfig, model_path: str, seed: int, prompt_overflow: str) -> None:
    # A scheduler's SIGTERM to the whole process tree must not kill the engine mid-step: the trainer finishes the
    # step, saves, and shuts the engine down itself. If the trainer dies, the pipe closes and this loop ends.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    capture_engine_output()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from megarl.rollout.engine import VLLMEngine

        engine = VLLMEngine(config, model_path, seed=seed, prompt_overflow=prompt_overflow)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("error", _describe(exc)))
        return
    conn.send(("ready", None))
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:  # the trainer is gone
            engine.shutdown()
            return
        if method == "shutdown":
            engine.shutdown()
            conn.send(("ok", None))
            return
        try:
            if method == "update_weights":
                result = engine.update_weights(_buckets_from(conn), **kwargs)
            elif method == "weight_version":
                result = engine.weight_version
            else:
                result = getattr(engine, method)(*args, **kwargs)
            conn.send(("ok", result))
        except BaseException as exc:  # noqa: BLE001
            conn.send(("error", _describe(exc)))


def _buckets_from(conn):
    while True:
        item = conn.recv()
        if isinstance(item, str) and item == _END:
            return
        yield item


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}\n--- engine process traceback ---\n{traceback.format_exc()}"


class EngineProcess:
    """A VLLMEngine living in a child process; the same methods as VLLMEngine."""

    def __init__(self, config: RolloutConfig, model_path: str, seed: int = 0, prompt_overflow: str = "error",
                 start_timeout_s: float = 600):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        saved = {k: os.environ.pop(k) for k in _DIST_VARS if k in os.environ}
        try:
            self._proc = ctx.Process(target=_serve, args=(child, config, str(model_path), seed, prompt_overflow),
                                     daemon=True, name="megarl-vllm-engine")
            self._proc.start()
        finally:
            os.environ.update(saved)
        child.close()
        if not self._conn.poll(start_timeout_s):
            self._proc.kill()
            raise EngineProcessError(f"the vLLM engine did not start within {start_timeout_s:.0f} s")
        status, payload = self._recv()
        if status == "error":
            self._proc.join(timeout=10)
            raise EngineProcessError(f"the vLLM engine failed to start: {payload}")

    def _recv(self):
        try:
            return self._conn.recv()
        except EOFError:
            raise EngineProcessError(f"the vLLM engine process died (exit code {self._proc.exitcode}); "
                                     f"{log_tail('vllm-engine') or 'see its log above for the reason'}") from None

    def _call(self, method: str, *args, **kwargs) -> Any:
        self._conn.send((method, args, kwargs))
        status, payload = self._recv()
        if status == "error":
            raise EngineProcessError(payload)
        return payload

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], **kwargs):
        return self._call("generate", [list(p) for p in prompt_token_ids], **kwargs)

    def sequence_logprobs(self, token_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        return self._call("sequence_logprobs", [list(t) for t in token_ids])

    def update_weights(self, buckets: Iterable[Sequence[tuple[str, torch.Tensor]]], verify: bool = False) -> dict:
        self._conn.send(("update_weights", (), {"verify": verify}))
        for bucket in buckets:
            self._conn.send([(name, t.detach().contiguous()) for name, t in bucket])
        self._conn.send(_END)
        status, payload = self._recv()
        if status == "error":
            raise EngineProcessError(payload)
        return payload

    @property
    def weight_version(self) -> int:
        return self._call("weight_version")

    def checksums(self):
        return self._call("checksums")

    def expected_checksums(self, hf_checksums):
        return self._call("expected_checksums", hf_checksums)

    def verify_weights(self, expected, rtol: float = 1e-9):
        return self._call("verify_weights", expected, rtol=rtol)

    def sleep(self, level: int = 1) -> None:
        self._call("sleep", level)

    def wake_up(self) -> None:
        self._call("wake_up")

    def abort(self) -> int:
        return self._call("abort")

    def shutdown(self, timeout_s: float = 30) -> None:
        if self._proc.is_alive():
            try:
                self._call("shutdown")
            except (EngineProcessError, BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=timeout_s)
        if self._proc.is_alive():
            self._proc.kill()

    def __del__(self):  # best effort: never leave an engine behind
        proc: Optional[Any] = getattr(self, "_proc", None)
        if proc is not None and proc.is_alive():
            proc.kill()
