"""Process lifetime: a fault anywhere ends the whole run within seconds, signals are honoured, no process outlives it.

Three mechanisms, each covering what the others cannot:

- Parent-death signals (`die_with_parent`): a child (a rank of the local launcher, the vLLM engine, a checkpoint
  writer) asks Linux to SIGKILL it when its parent dies, so even a SIGKILLed parent leaves no orphan.
- A watchdog thread per rank (`Watchdog`): a rank that fails publishes its error in the rendezvous store; a rank that
  dies without a word stops its heartbeat. Every other rank's watchdog sees either within seconds and ends its process,
  although its main thread may be blocked in a collective that would otherwise wait out the process group's
  30-minute timeout. Each rank watches one neighbour's heartbeat, so the store sees O(world) requests per interval.
- Signal handling (`SignalWatcher`): SIGINT and SIGTERM are read by a thread from a wakeup pipe, not by a Python
  handler in the main thread, which would only run once a blocking C call (a collective) returns. The first signal
  asks the run to stop after the current step (or ends it at once when there is nothing to save); a second one ends
  it at once.

Exit codes: a rank stopped because another rank failed exits with PEER_FAILED_EXIT, so launchers can tell the root
cause from its consequences; a rank ended by a signal exits with 128 + the signal number, as a shell would report.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import signal
import sys
import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from typing import Callable, Iterator, Optional

PEER_FAILED_EXIT = 75
_PR_SET_PDEATHSIG = 1


class PeerFailure(RuntimeError):
    """This rank stops because another rank failed first; the message names that rank and its error."""


class Explained(Exception):
    """Mixed into errors whose message already says the cause and the fix (an engine that cannot start, a refused
    input): a rank shows them as one line, never with a traceback."""


TROUBLESHOOTING = "docs/troubleshooting.md"


def see(error_id: str) -> str:
    """'(troubleshooting: docs/troubleshooting.md#<error_id>)', the end of a one-line error: where its cause and fix
    are explained at length. Pass the id as a literal: tests/unit/test_error_ids.py reads every id from the code and
    holds it against the page's headings."""
    return f"(troubleshooting: {TROUBLESHOOTING}#{error_id})"


# ---------------------------------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------------------------------


def die_with_parent(parent_pid: Optional[int] = None, sig: int = signal.SIGKILL) -> bool:
    """Have Linux send `sig` to this process when its parent exits (prctl PR_SET_PDEATHSIG). Returns False where the
    call is not available (not Linux). If `parent_pid` is given and the parent is already gone (it died before the
    request took effect), exit now.

    The signal fires when the parent *thread* that started this process exits, so start children from the main
    thread."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)
    return True


def bind_to_parent(parent_pid: int) -> None:
    """For a helper child (the engine): SIGINT from a terminal and SIGTERM from a scheduler reach the whole process
    group, but only the trainer decides when its helpers stop (it may first finish the step and save), so ignore
    them; and die with the parent, so that the helper never outlives the trainer."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent(parent_pid)


def kill_at_exit(proc) -> None:
    """Kill a multiprocessing child (and its descendants) when this interpreter exits, before multiprocessing's own
    exit handler would SIGTERM and then join it forever (a helper ignores SIGTERM, see bind_to_parent)."""
    ref = weakref.ref(proc)

    def _kill() -> None:
        p = ref()
        if p is not None and p.pid is not None and p.is_alive():
            kill_tree(p.pid)

    atexit.register(_kill)


def kill_tree(pid: int, timeout_s: float = 5.0) -> None:
    """SIGKILL `pid` and all its descendants, then wait up to timeout_s for them to be gone. The tree is stopped
    (SIGSTOP) and listed before anything is killed, so none escapes by forking or by being re-parented."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = _stopped_tree(root)
    if not procs:
        return
    _kill(procs)
    try:
        root.wait(timeout=timeout_s)  # reaps it when it is our child
    except (psutil.TimeoutExpired, psutil.NoSuchProcess, ChildProcessError):
        pass
    _wait_gone(procs, timeout_s)


def _stopped_tree(root) -> list:
    """root and its descendants, each stopped (SIGSTOP) before the next pass lists what it forked; [] when root is
    gone (killed and reaped by another thread meanwhile: exit_now's, say)."""
    import psutil

    try:
        root.suspend()
    except psutil.NoSuchProcess:
        return []
    procs = [root]
    for _ in range(2):  # a second pass finds what was forked while the first one stopped the tree
        try:
            children = root.children(recursive=True)
        except psutil.NoSuchProcess:
            break
        for p in children:
            try:
                p.suspend()
            except psutil.NoSuchProcess:
                continue
            if p not in procs:
                procs.append(p)
    return procs


def _kill(procs: list) -> None:
    """SIGKILL stopped processes (a stopped process keeps its pid: no other process can have taken it). os.kill, not
    psutil's kill, which reads /proc first and so lets other threads run between two kills."""
    for p in procs:
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait_gone(procs: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_running(p) for p in procs):  # orphans are reaped by init, or not at all
        time.sleep(0.02)


def _running(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_children(timeout_s: float = 5.0) -> None:
    """SIGKILL every descendant of this process (before this process ends abruptly with os._exit), then wait up to
    timeout_s for them to be gone. All are stopped before the first is killed: while this runs on one thread, the
    others see no helper die."""
    import psutil

    procs = [p for child in psutil.Process().children() for p in _stopped_tree(child)]
    _kill(procs)
    _wait_gone(procs, timeout_s)


def exit_now(code: int, message: str) -> None:
    """End this process at once from any thread: print `message` (in the process's log and, where its output is
    captured, on the terminal too), kill its descendants, os._exit(code).

    It does not wait for the killed ones to be gone: meanwhile the main thread would see its helpers die and raise
    errors of its own, whose tracebacks would bury the message. Each child dies by its SIGKILL alone."""
    from megarl import console

    try:
        print(message, file=sys.stderr, flush=True)
        if console.terminal() is not sys.stderr:
            console.say(message)
        kill_children(timeout_s=0)
    finally:
        os._exit(code)


# ---------------------------------------------------------------------------------------------------------------------
# Peer failures
# ---------------------------------------------------------------------------------------------------------------------


class Watchdog:
    """Ends this rank (exit_now with PEER_FAILED_EXIT) when another rank reports a failure or its heartbeat stops.

    store: a torch.distributed Store shared by all ranks (the process group's rendezvous store). Every interval_s the
    thread writes this rank's heartbeat, reads the abort key and checks rank (rank + 1) % world's heartbeat; a
    heartbeat unchanged for stale_s seconds, or a store that stays unreachable that long (its host, rank 0 or the
    launcher, is gone), ends the run. Call stop() when the rank's part of the run is over: a stopped rank marks its
    heartbeat as done so that its watcher does not take the end of the run for a death.
    """

    ABORT = "abort"

    def __init__(self, store, rank: int, world_size: int, interval_s: float = 1.0, stale_s: float = 30.0,
                 on_abort: Optional[Callable[[str], None]] = None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.interval_s, self.stale_s = interval_s, stale_s
        self.on_abort = on_abort or (lambda msg: exit_now(PEER_FAILED_EXIT, f"megarl: rank {rank} stopping: {msg}"))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="megarl-watchdog", daemon=True)

    def start(self) -> "Watchdog":
        self._thread.start()
        return self

    def report_failure(self, message: str) -> Optional[str]:
        """Publish this rank's failure so that every other rank stops. Returns the failure another rank published
        first (this rank's error is then most likely a consequence of it), or None if this one is the first."""
        self._stop.set()  # this rank ends by itself, printing its own error: its watchdog must not end it first
        return self._publish(f"rank {self.rank} failed: {message}")

    def _publish(self, message: str) -> Optional[str]:
        try:
            current = self.store.compare_set(self.ABORT, "", message).decode()
        except Exception:  # noqa: BLE001 - the store's host is gone: the peers learn it from the store themselves
            return None
        return None if current == message else current

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            self.store.set(self._beat_key(self.rank), "done")
        except Exception:  # noqa: BLE001 - nothing left to tell
            pass

    def _beat_key(self, rank: int) -> str:
        return f"heartbeat/{rank}"

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world_size
        beat, seen, seen_at, reached_at = 0, None, time.monotonic(), time.monotonic()
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(self._beat_key(self.rank), str(beat))
                if self.store.check([self.ABORT]):
                    message = self.store.get(self.ABORT).decode()
                    if message:
                        return self._abort(message)
                value = self.store.get(self._beat_key(neighbour)) if self.store.check(
                    [self._beat_key(neighbour)]) else None
                reached_at = now
            except Exception as exc:  # noqa: BLE001 - an unreachable store is itself the news
                if now - reached_at > min(self.stale_s, 10.0):
                    return self._abort(f"lost contact with the rendezvous store ({type(exc).__name__}: {exc}); "
                                       "the rank or launcher hosting it is gone")
                continue
            if value != seen or value == b"done":
                seen, seen_at = value, now
            elif now - seen_at > self.stale_s:
                message = (f"rank {neighbour} stopped responding (no heartbeat for {now - seen_at:.0f} s; killed, "
                           "or stuck without releasing the GIL)")
                return self._abort(self._publish(message) or message)

    def _abort(self, message: str) -> None:
        if not self._stop.is_set():
            self.on_abort(message)


# ---------------------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------------------


class SignalWatcher:
    """SIGINT and SIGTERM, handled on a thread so that they work while the main thread is blocked in C.

    on_first(signum) is called (on the watcher thread) for the first signal, e.g. to request a checkpoint and a stop
    at the end of the step; without it the first signal ends the process at once, as does always the second.
    Install from the main thread; close() restores the previous handlers.
    """

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, on_first: Optional[Callable[[int], None]] = None):
        self.on_first = on_first
        self.count = 0
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = {s: signal.signal(s, _no_op) for s in self.SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._run, name="megarl-signals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                data = os.read(self._read, 64)
            except OSError:  # closed
                return
            if not data:
                return
            for signum in data:
                if signum == 0:  # close()
                    return
                if signum in self.SIGNALS:
                    self._handle(signum)

    def _handle(self, signum: int) -> None:
        self.count += 1
        name = signal.Signals(signum).name
        if self.count == 1 and self.on_first is not None:
            self.on_first(signum)
            return
        why = "a second signal" if self.count > 1 else "no checkpoint.save_on_sigterm"
        exit_now(128 + signum, f"megarl: {name} received ({why}): stopping now")

    def close(self) -> None:
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, signal.SIG_DFL if handler is None else handler)
        os.write(self._write, b"\0")  # ends the thread (a forked child may hold the pipe open: no EOF to count on)
        self._thread.join(timeout=5)
        os.close(self._write)
        os.close(self._read)


def _no_op(signum, frame) -> None:
    """The watcher thread acts on the signal; the Python-level handler only has to exist for the wakeup fd."""


# ---------------------------------------------------------------------------------------------------------------------
# One rank's run
# ---------------------------------------------------------------------------------------------------------------------

_watchdog: Optional[Watchdog] = None


def start_watchdog() -> None:
    """Start this process's watchdog over the default process group's store (a no-op for a world of one). Its
    staleness limit comes from MEGARL_WATCHDOG_STALE_S (default 30 s)."""
    global _watchdog
    import torch.distributed as dist

    if _watchdog is None and dist.is_initialized() and dist.get_world_size() > 1:
        store = dist.PrefixStore("megarl/watchdog/", dist.distributed_c10d._get_default_store())
        stale = float(os.environ.get("MEGARL_WATCHDOG_STALE_S", "30"))
        _watchdog = Watchdog(store, dist.get_rank(), dist.get_world_size(), stale_s=stale).start()


def stop_watchdog() -> None:
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None


@contextmanager
def supervised(teardown: Callable[[], None]) -> Iterator[ExitStack]:
    """Run one rank's part of a job (after the process group is up) under a watchdog.

    Cleanups registered on the yielded ExitStack (the engine's shutdown, ...) always run. On an exception the other
    ranks are told first, so that they stop instead of waiting in a collective; an error that merely follows another
    rank's failure is re-raised as PeerFailure naming the root cause. teardown() (the process group) runs last."""
    start_watchdog()
    try:
        with ExitStack() as cleanups:
            try:
                yield cleanups
            except BaseException as exc:
                first = _watchdog.report_failure(f"{type(exc).__name__}: {exc}") if _watchdog else None
                if first is not None:
                    raise PeerFailure(first) from exc
                raise
    finally:
        stop_watchdog()
        teardown()
