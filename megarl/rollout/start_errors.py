"""Why an engine worker failed to start, told to the engine that started it.

At engine TP > 1 vLLM's workers are processes of their own: one that fails to start logs its traceback ("WorkerProc
failed to start.") into the engine's output and closes its pipe, and the engine raises only "WorkerProc
initialization failed due to an exception in a background process". For the cause to reach the console in one line,
the engine names a directory in WORKER_ERRORS_ENV while it starts; each worker (megarl.rollout.vllm.worker_ext installs
the handler when vLLM imports it, before the worker builds its model) writes the exception it failed with there, and the
engine reads the first one.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Optional

WORKER_ERRORS_ENV = "MEGARL_ENGINE_WORKER_ERRORS"
# the logger vLLM 0.32's worker_main reports a worker's start failure on (logger.exception)
VLLM_WORKER_LOGGER = "vllm.v1.executor.multiproc_executor"
_MAX_CHARS = 400


def one_line(text: str, limit: int = _MAX_CHARS) -> str:
    """The text on one line (whitespace runs folded), cut at `limit` characters."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def describe_exception(exc: BaseException) -> str:
    """'Type: message' of an exception, on one line."""
    return one_line(f"{type(exc).__name__}: {exc}")


class _WorkerStartFailure(logging.Handler):
    """Writes the exception of the first error record with one into `directory`/<pid>.txt."""

    def __init__(self, directory: str):
        super().__init__(level=logging.ERROR)
        self.directory = directory
        self.written = False

    def emit(self, record: logging.LogRecord) -> None:
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or self.written:
            return
        try:
            Path(self.directory, f"{os.getpid()}.txt").write_text(describe_exception(exc))
            self.written = True
        except OSError:  # the engine is gone or cleaned up: nobody to tell
            pass


def record_worker_start_failures() -> bool:
    """In an engine worker started while its engine collects start failures: report this worker's. True if armed."""
    directory = os.environ.get(WORKER_ERRORS_ENV)
    if not directory or not os.path.isdir(directory):
        return False
    logger = logging.getLogger(VLLM_WORKER_LOGGER)
    if not any(isinstance(h, _WorkerStartFailure) for h in logger.handlers):
        logger.addHandler(_WorkerStartFailure(directory))
    return True


def first_worker_error(directory: str) -> Optional[str]:
    """The earliest exception a worker recorded in `directory` (None: none did)."""
    files = sorted(Path(directory).glob("*.txt"), key=lambda p: p.stat().st_mtime)
    for path in files:
        text = path.read_text().strip()
        if text:
            return text
    return None


@contextlib.contextmanager
def collecting_worker_errors() -> Iterator[Callable[[], Optional[str]]]:
    """Around an engine start: workers started inside record why they failed; yields a function returning the first
    such cause (None if no worker recorded one)."""
    directory = tempfile.mkdtemp(prefix="megarl-engine-start-")
    previous = os.environ.get(WORKER_ERRORS_ENV)
    os.environ[WORKER_ERRORS_ENV] = directory
    try:
        yield lambda: first_worker_error(directory)
    finally:
        if previous is None:
            os.environ.pop(WORKER_ERRORS_ENV, None)
        else:
            os.environ[WORKER_ERRORS_ENV] = previous
        shutil.rmtree(directory, ignore_errors=True)
