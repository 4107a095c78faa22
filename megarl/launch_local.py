"""Start N local ranks of a Python function, the way torchrun would, and collect what each returns.

Used by `megarl verify` (which starts the ranks a layout needs when it is not already under torchrun) and by
the multi-rank tests. Each rank is a fresh interpreter (`python -m megarl.launch_local`), so megatron's
global parallel state and the CPU patches never leak into the caller. A process that launches many short rank groups
(the test suite) can have them forked instead from a server that imported torch and megatron-core once
(`fork_ranks_from`): the ranks still never share state with the caller or with each other.
"""
from __future__ import annotations

import atexit
import faulthandler
import importlib
import multiprocessing
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional, Sequence

from megarl import lifecycle
from megarl.distributed import free_port

_LAUNCHER_PID = "MEGARL_LAUNCHER_PID"
_fork_preload: Optional[list] = None  # what the rank server imports, once fork_ranks_from() was called
_fork_server_env: dict = {}
_fork_context: Optional[Any] = None


class RankFailure(RuntimeError):
    """One or more ranks exited non-zero; the message carries the tail of each failing rank's log."""


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else []
    return "\n".join(text[-lines:])


def _wait_all(procs: list, timeout: float, grace: float = 5.0, peer_grace: float = 25.0) -> tuple[list, Optional[int]]:
    """Wait for every process; once one fails (or time runs out) give the rest `grace` seconds, then kill them (with
    their children: a rank's engine). A rank that stopped because another one failed (lifecycle.PEER_FAILED_EXIT)
    gives the failing rank `peer_grace` seconds to clean up and print its error.

    A crashed rank leaves its peers blocked in a collective (their watchdogs normally end them sooner), so waiting for
    each in turn would hang until the timeout. Returns each exit code, or "timeout"/"killed after rank N failed", and
    the rank that failed first, not counting ranks that only stopped because another one failed.
    """
    deadline = time.monotonic() + timeout
    codes: list = [None] * len(procs)
    first_failure = None
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None and p.poll() is not None:
                codes[i] = p.returncode
                if p.returncode != 0 and (first_failure is None or codes[first_failure] == lifecycle.PEER_FAILED_EXIT):
                    first_failure = i
                    wait = peer_grace if p.returncode == lifecycle.PEER_FAILED_EXIT else grace
                    deadline = min(deadline, time.monotonic() + wait)
        if time.monotonic() > deadline:
            for i, p in enumerate(procs):
                if codes[i] is None:
                    lifecycle.kill_tree(p.pid)
                    p.wait()
                    codes[i] = "timeout" if first_failure is None else f"killed after rank {first_failure} failed"
        time.sleep(0.05)
    return codes, first_failure


@contextmanager
def _forwarding_signals(procs: list):
    """While the ranks run, pass SIGINT/SIGTERM sent to the launcher on to them (they run in sessions of their own, so a
    terminal's Ctrl-C reaches them only this way, once): each rank then saves and stops, or stops at once."""
    def forward(signum, frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    try:
        previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    except ValueError:  # not the main thread: the caller keeps its own handling
        previous = {}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _failure_report(target: str, codes: list, first: Optional[int], logs: Path) -> str:
    """The rank that failed first with its log tail, then one line per rank that followed it."""
    order = sorted((r for r, c in enumerate(codes) if c != 0), key=lambda r: r != first)
    lines = [f"{len(order)} of {len(codes)} ranks of {target} failed:"]
    for r in order:
        log = logs / f"rank{r}.log"
        if r == first or first is None:
            lines.append(f"--- rank {r} exited with {codes[r]}; last lines of {log}:\n{_tail(log)}")
        else:
            why = " (stopped because another rank failed)" if codes[r] == lifecycle.PEER_FAILED_EXIT else ""
            lines.append(f"--- rank {r} exited with {codes[r]}{why}; its log: {log}")
    return "\n".join(lines)


def fork_ranks_from(preload: Sequence[str], start_now: bool = False, server_env: Optional[dict] = None) -> None:
    """From now on, start ranks by forking a server process that imported `preload` once (multiprocessing's
    forkserver, started at the first launch), not as fresh interpreters: importing torch and megatron-core costs each
    rank about 3 s on 2 CPU cores, which dominates a short launch. The server imports with this process's environment,
    OMP_NUM_THREADS=1 (a rank's default) and `server_env`; each rank then takes its own environment, session and log
    as a fresh one would.

    Ranks given an `env` of their own still start fresh (a variable that takes effect at import, say a kernel choice,
    must not come from the server), and so do the ranks of a launch that streams rank 0 to this console. start_now:
    start the server at once, so that it imports while this process goes on."""
    global _fork_preload, _fork_server_env
    _fork_preload = list(preload)
    _fork_server_env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or "1", **(server_env or {})}
    if start_now:
        _forkserver()


def _forkserver() -> Any:
    """The forkserver context, its server started with the preload on first use."""
    global _fork_context
    if _fork_context is None:
        from multiprocessing import forkserver

        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(_fork_preload)
        # the server inherits this process's environment when it starts, and only then (libgomp, for one, reads
        # OMP_NUM_THREADS once, when the server imports torch)
        saved = {k: os.environ.get(k) for k in _fork_server_env}
        os.environ.update(_fork_server_env)
        try:
            forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    del os.environ[k]
                else:
                    os.environ[k] = v
        _fork_context = ctx
    return _fork_context


class _ForkedRank:
    """A rank forked by the server, with the part of subprocess.Popen's interface the launcher uses."""

    def __init__(self, process):
        self._process, self.pid = process, process.pid

    @property
    def returncode(self) -> Optional[int]:
        return self._process.exitcode

    def poll(self) -> Optional[int]:
        return self._process.exitcode

    def wait(self) -> Optional[int]:
        self._process.join()
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)


def _forked_rank_main(target: str, work: str, env: dict, log_path: str) -> None:
    """A forked rank: what `python -m megarl.launch_local` does, after taking what a fresh rank gets from Popen."""
    os.setsid()  # its own session, as start_new_session gives the fresh ones
    os.environ.clear()
    os.environ.update(env, **{_LAUNCHER_PID: str(os.getppid())})  # dies with the server, which dies with the launcher
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS") or 1))  # the server's torch was imported before this env
    try:
        _rank_process(target, work)
    finally:
        # what the interpreter's exit runs (the reward workers' shutdown, say) and a multiprocessing child skips:
        # multiprocessing would join those workers, which ignore its SIGTERM, forever
        atexit._run_exitfuncs()


def _start_rank(target: str, work: Path, env: dict, log_path: Optional[Path], forked: bool) -> tuple:
    """One rank, forked from the server or a fresh interpreter; log_path None: a fresh one writing to this console.
    Returns the process and the log file to close after it (None when there is none to close here)."""
    if forked:
        process = _forkserver().Process(target=_forked_rank_main, args=(target, str(work), env, str(log_path)))
        process.start()
        return _ForkedRank(process), None
    log = open(log_path, "w") if log_path is not None else None
    cmd = [sys.executable, "-m", "megarl.launch_local", target, str(work)]
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT if log else None,
                            start_new_session=True), log


def run_ranks(target: str, nprocs: int, kwargs: Optional[dict] = None, timeout: Optional[float] = 600,
              env: Optional[dict] = None, log_dir: Optional[str] = None, stream_rank0: bool = False) -> list[Any]:
    """Run `target` ("package.module:function") on `nprocs` ranks; return each rank's return value.

    The function is called as `function(**kwargs)` after torch.distributed is initialised (gloo on CPU, NCCL on
    GPU); megatron's model-parallel state is left to the function. Rank logs go to `log_dir` (a temp dir if None);
    with stream_rank0, rank 0 writes to this process's console instead. timeout=None waits as long as it takes.
    Raises RankFailure with each failing rank's log tail, or on timeout.
    """
    work = Path(tempfile.mkdtemp(prefix="megarl-ranks-"))
    logs = Path(log_dir) if log_dir else work
    logs.mkdir(parents=True, exist_ok=True)
    (work / "kwargs.pkl").write_bytes(pickle.dumps(kwargs or {}))
    port = free_port()
    procs = []
    for rank in range(nprocs):
        rank_env = dict(os.environ, **(env or {}))
        rank_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_WORLD_SIZE=str(nprocs),
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=rank_env.get(
                            "OMP_NUM_THREADS", "1"), **{_LAUNCHER_PID: str(os.getpid())})
        log_path = None if (stream_rank0 and rank == 0) else logs / f"rank{rank}.log"
        forked = _fork_preload is not None and env is None and not stream_rank0
        procs.append(_start_rank(target, work, rank_env, log_path, forked))
    with _forwarding_signals([p for p, _ in procs]):
        codes, first = _wait_all([p for p, _ in procs], float("inf") if timeout is None else timeout)
    for _, log in procs:
        if log is not None:
            log.close()
    if any(code != 0 for code in codes):
        raise RankFailure(_failure_report(target, codes, _first_failure(work, nprocs, first), logs))
    results = [pickle.loads((work / f"result{r}.pkl").read_bytes()) for r in range(nprocs)]
    shutil.rmtree(work, ignore_errors=True)  # kept after a failure: the report names the logs in it
    return results


def _rank_main(target: str, work: str) -> None:
    import torch.distributed

    from megarl import distributed
    from megarl.megatron import parallel

    if os.environ.get(_LAUNCHER_PID):  # a SIGKILLed launcher must not leave its ranks running
        lifecycle.die_with_parent(int(os.environ[_LAUNCHER_PID]))
    module_name, fn_name = target.split(":")
    fn = getattr(importlib.import_module(module_name), fn_name)
    kwargs = pickle.loads((Path(work) / "kwargs.pkl").read_bytes())
    if os.environ.get("MEGARL_HANG_DUMP_S"):  # print every thread's stack if a rank hangs this long, then exit
        faulthandler.dump_traceback_later(float(os.environ["MEGARL_HANG_DUMP_S"]), exit=True)
    distributed.init_distributed()
    rank = distributed.rank()
    try:
        result = fn(**kwargs)
        (Path(work) / f"result{rank}.pkl").write_bytes(pickle.dumps(result))
        # A rank that returns early (a first pipeline stage) must not tear down the group under an async send.
        if torch.distributed.is_initialized():  # a supervised job (the trainer) has torn it down itself
            torch.distributed.barrier()
    except lifecycle.PeerFailure as exc:  # the root cause is printed by the rank where it happened
        print(f"megarl: rank {rank} stopping: {exc}", file=sys.stderr)
        sys.exit(lifecycle.PEER_FAILED_EXIT)
    except lifecycle.Explained as exc:  # the message says the cause and the fix: no traceback
        _note_failure(work, rank)
        print(f"megarl: rank {rank}: {exc}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        _note_failure(work, rank)
        raise
    finally:
        parallel.destroy()


def _note_failure(work: str, rank: int) -> None:
    """When this rank's error happened: the launcher names the earliest as the cause. The order in which the ranks'
    exits are seen is not that order: a peer blocked in a collective fails the moment the failing rank's socket
    closes, and may be reaped first."""
    (Path(work) / f"failed{rank}").write_text(repr(time.time()))


def _first_failure(work: Path, nprocs: int, first_seen: Optional[int]) -> Optional[int]:
    """The rank whose error came first by the ranks' own notes; the first failing exit seen where that rank left no
    note (killed by a signal, a crash in native code: nothing ran after it)."""
    stamps = {r: float((work / f"failed{r}").read_text()) for r in range(nprocs) if (work / f"failed{r}").exists()}
    if not stamps or (first_seen is not None and first_seen not in stamps):
        return first_seen
    return min(stamps, key=stamps.get)


def _rank_process(target: str, work: str) -> None:
    """A rank process's whole life, fresh or forked."""
    from megarl.console import captured

    with captured(f"rank{os.environ.get('RANK', '0')}"):  # a no-op unless the job asks for log files
        _rank_main(target, work)


if __name__ == "__main__":
    _rank_process(sys.argv[1], sys.argv[2])
