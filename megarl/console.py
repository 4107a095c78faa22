"""What a run shows on the terminal, and where everything else goes.

A `megarl train` / `megarl sft` run keeps the terminal for the user: a few progress lines, a line per reported step,
a summary, and errors. Everything the libraries print (vLLM's start-up logs, Megatron's warnings and gradient-bucket
lists, C++ warnings, progress bars) goes to `<run_dir>/logs/<process>.log`: `rank<N>.log` per trainer rank and
`vllm-engine.log` per engine process. With `logging.verbose` (`--verbose`) or `logging.level=DEBUG` the terminal
shows all of it too (the log files are still written).

Why file descriptors, not logging handlers: vLLM configures its own handlers, C++ code writes to fd 2 directly, and
the engine is a separate process. Redirecting fds 1 and 2 of every process megarl starts catches all of it. The
processes learn where to write from two environment variables, which the launcher and the engine inherit.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import subprocess
import sys
from pathlib import Path
from typing import Iterator, Optional, TextIO

LOG_DIR_ENV = "MEGARL_LOG_DIR"
VERBOSE_ENV = "MEGARL_VERBOSE"

# Loggers under this name write to the process output (the rank's log file when captured) but never to the terminal
# of a quiet run: lines a user reads in the log, not as the run goes (validation generations).
LOG_ONLY = "megarl.log_only"

# The terminal of a captured, quiet process (a dup of its original stderr); None when output is not captured.
_terminal: Optional[TextIO] = None
_engine_redirect = None  # holds the engine process's tee, if any, for the life of the process


def log_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "logs"


def verbose(cfg) -> bool:
    return bool(cfg.logging.verbose or cfg.logging.level == "DEBUG")


def job_env(cfg) -> dict[str, str]:
    """The variables that make every process of this job (ranks, engines) write its output under the run dir."""
    return {LOG_DIR_ENV: str(log_dir(cfg.trainer.run_dir).resolve()), VERBOSE_ENV: "1" if verbose(cfg) else "0"}


def terminal() -> TextIO:
    """Where lines meant for the user go: the terminal, even while fds 1 and 2 point at a log file."""
    return _terminal if _terminal is not None else sys.stderr


def say(line: str) -> None:
    out = terminal()
    # on a terminal, first erase a live progress line the metrics logger may have left
    print(("\r\x1b[K" if out.isatty() else "") + line, file=out, flush=True)


def log_tail(name: str, lines: int = 20) -> str:
    """The last lines of a process's log file of this job, for an error message; "" when output is not captured."""
    directory = os.environ.get(LOG_DIR_ENV)
    path = Path(directory) / f"{name}.log" if directory else None
    if path is None or not path.is_file():
        return ""
    tail = path.read_text(errors="replace").splitlines()[-lines:]
    return f"the last lines of {path}:\n" + "\n".join(tail)


def _redirect(path: Path, tee: bool) -> tuple[int, int, Optional[subprocess.Popen]]:
    """Point fds 1 and 2 at `path` (appending), or at a `tee` into it and the terminal; return what restores them."""
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    proc = None
    if tee:  # a separate process, so nothing buffered is lost if this one crashes
        proc = subprocess.Popen(["tee", "-a", str(path)], stdin=subprocess.PIPE, stdout=saved_err)
        target = proc.stdin.fileno()
    else:
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(target, 1)
    os.dup2(target, 2)
    if proc is None:
        os.close(target)
    return saved_out, saved_err, proc


def _restore(saved_out: int, saved_err: int, proc: Optional[subprocess.Popen]) -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(saved_out, 1)
    os.dup2(saved_err, 2)
    os.close(saved_out)
    if proc is not None:
        proc.stdin.close()
        proc.wait()


@contextlib.contextmanager
def captured(name: str) -> Iterator[None]:
    """Inside: this process's output goes to `<MEGARL_LOG_DIR>/<name>.log`; a no-op when the variable is unset.

    On the way out (normally or by an exception) fds 1 and 2 are restored first, so the traceback Python prints for
    an uncaught error reaches the terminal (or the launcher's log of this rank), not only the file."""
    global _terminal
    directory = os.environ.get(LOG_DIR_ENV)
    if not directory:
        yield
        return
    tee = os.environ.get(VERBOSE_ENV) == "1"
    saved_out, saved_err, proc = _redirect(Path(directory) / f"{name}.log", tee)
    previous = _terminal
    if not tee:
        _terminal = os.fdopen(os.dup(saved_err), "w", buffering=1)
    try:
        yield
    finally:
        if _terminal is not previous:
            _terminal.close()
        _terminal = previous
        _restore(saved_out, saved_err, proc)
        os.close(saved_err)


@contextlib.contextmanager
def job_output(cfg) -> Iterator[None]:
    """Around a job run in this process (one rank, or a rank of torchrun): set the job's variables so the engine it
    starts inherits them, and capture this process's output as `rank<RANK>.log`."""
    env = job_env(cfg)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with captured(f"rank{os.environ.get('RANK', '0')}"):
            yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def capture_engine_output() -> None:
    """Called first thing in an engine process: its output (vLLM's logs, C++ warnings) goes to its own log file,
    named after the process (`megarl-vllm-engine` -> `vllm-engine.log`; replicas need distinct process names)."""
    global _engine_redirect
    directory = os.environ.get(LOG_DIR_ENV)
    if directory:  # for the life of the process, never restored: the engine reports its errors through its pipe
        name = multiprocessing.current_process().name.removeprefix("megarl-")
        _engine_redirect = _redirect(Path(directory) / f"{name}.log", tee=os.environ.get(VERBOSE_ENV) == "1")
    # megarl's own lines of the engine process (its start line names the replica's node and devices) go to the same
    # output: a spawned process starts with no logging set up, and Python's last-resort handler drops INFO
    ours = logging.getLogger("megarl")
    if not ours.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        ours.addHandler(handler)
        ours.setLevel(logging.INFO)
        ours.propagate = False


class _TerminalHandler(logging.Handler):
    """megarl's own messages, and errors from anywhere, on the terminal of a quiet, captured rank 0."""

    def filter(self, record: logging.LogRecord) -> bool:
        ours = record.name.startswith("megarl") and not record.name.startswith(LOG_ONLY)
        return _terminal is not None and (ours or record.levelno >= logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            say(self.format(record))
        except ValueError:  # the terminal stream was closed by the end of the job
            pass


def setup_logging(level: str, is_rank0: bool) -> None:
    """Python logging of a trainer rank: every logger at `level` into the process output (the rank's log file when
    captured); on rank 0 also megarl's messages and errors on the terminal."""
    logging.basicConfig(level=getattr(logging, level), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    root = logging.getLogger()
    if not is_rank0:
        logging.getLogger("megarl").setLevel(logging.WARNING)
    elif not any(isinstance(h, _TerminalHandler) for h in root.handlers):
        root.addHandler(_TerminalHandler())
    if is_rank0 and _terminal is not None:
        where = os.path.relpath(os.environ[LOG_DIR_ENV])
        say(f"logs of vLLM, Megatron and each rank: {where if not where.startswith('..') else os.environ[LOG_DIR_ENV]}"
            "/ (--verbose shows them here)")
