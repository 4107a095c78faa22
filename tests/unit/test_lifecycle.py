"""megarl.lifecycle on its own: the watchdog over a real TCPStore, parent-death signals, process-tree kills, and the
signal watcher (in child interpreters, so that signals and os._exit never touch the test process)."""
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import timedelta

import psutil
import pytest
import torch.distributed as dist

from megarl.lifecycle import Watchdog, kill_tree

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl and /proc are Linux")


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", 0, 1, True, timedelta(seconds=10))


def _watchdogs(store, world, stale_s=30.0):
    aborts = {r: threading.Event() for r in range(world)}
    messages = {}

    def on_abort(rank):
        def record(message):
            messages[rank] = message
            aborts[rank].set()
        return record

    dogs = [Watchdog(dist.PrefixStore("w/", store), r, world, interval_s=0.05, stale_s=stale_s, on_abort=on_abort(r))
            for r in range(world)]
    return dogs, aborts, messages


def test_a_reported_failure_stops_the_other_ranks_not_the_reporter(store):
    dogs, aborts, messages = _watchdogs(store, 3)
    for d in dogs:
        d.start()
    assert dogs[1].report_failure("ValueError: boom") is None  # the first failure: the root cause
    assert aborts[0].wait(5) and aborts[2].wait(5)
    assert messages[0] == messages[2] == "rank 1 failed: ValueError: boom"
    # a later failure elsewhere is a consequence: it learns the root cause
    assert dogs[2].report_failure("RuntimeError: connection closed") == "rank 1 failed: ValueError: boom"
    time.sleep(0.3)
    assert not aborts[1].is_set()
    for d in dogs:
        d.stop()


def test_a_rank_whose_heartbeat_stops_is_declared_dead(store):
    dogs, aborts, messages = _watchdogs(store, 2, stale_s=0.5)
    dogs[0].start()  # rank 1 never beats: as if it had been killed
    assert aborts[0].wait(5)
    assert messages[0].startswith("rank 1 stopped responding")
    dogs[0].stop()


def test_a_rank_that_finished_is_not_taken_for_dead(store):
    dogs, aborts, _ = _watchdogs(store, 2, stale_s=0.5)
    for d in dogs:
        d.start()
    dogs[1].stop()  # done: its watcher must not count the silence that follows
    time.sleep(1.5)
    assert not aborts[0].is_set()
    dogs[0].stop()


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def _gone(pid: int, timeout: float = 10) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_child_dies_with_its_parent_even_after_sigkill():
    parent = _python("""
        import os, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import os, time; from megarl.lifecycle import die_with_parent; "
                                  f"die_with_parent({os.getpid()}); print('bound', flush=True); time.sleep(60)"],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "bound"
        print(child.pid, flush=True)
        time.sleep(60)
    """)
    child = int(parent.stdout.readline())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    assert _gone(child)


def test_kill_tree_kills_every_descendant():
    root = _python("""
        import subprocess, sys, time
        kids = [subprocess.Popen(["sleep", "60"]) for _ in range(2)]
        print(" ".join(str(k.pid) for k in kids), flush=True)
        time.sleep(60)
    """)
    kids = [int(p) for p in root.stdout.readline().split()]
    kill_tree(root.pid)
    root.wait()
    assert all(_gone(k) for k in kids)


SIGNALS = """
    import os, signal, sys, time
    from megarl.lifecycle import SignalWatcher
    watcher = SignalWatcher(on_first={on_first})
    print("ready", flush=True)
    time.sleep(30)  # the main thread is busy: the watcher thread acts
    sys.exit(0)
"""


def test_first_signal_requests_a_stop_and_the_second_ends_at_once():
    proc = _python(SIGNALS.format(on_first="lambda s: print('stop requested', signal.Signals(s).name, flush=True)"))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.stdout.readline().strip() == "stop requested SIGTERM"
    assert proc.poll() is None
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 128 + signal.SIGINT
    assert "SIGINT received (a second signal): stopping now" in proc.stderr.read()


def test_without_a_save_the_first_signal_ends_at_once():
    proc = _python(SIGNALS.format(on_first="None"))
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 128 + signal.SIGTERM
    assert "no checkpoint.save_on_sigterm" in proc.stderr.read()


def test_a_second_signal_is_said_on_the_terminal_of_a_captured_run_and_its_helpers_dying_add_nothing(tmp_path):
    """A run whose output goes to its log (megarl.console.captured) gets a second SIGINT while its main thread waits
    on a helper, as rank 0 waits on its reward workers: the terminal shows why it stopped, in one line, and the main
    thread, seeing the helper die, adds no traceback of its own before the process ends."""
    proc = _python(f"""
        import multiprocessing as mp, os
        from megarl import console
        from megarl.lifecycle import SignalWatcher, kill_tree

        def helper(conn):
            conn.recv()  # never answers

        os.environ[console.LOG_DIR_ENV] = {str(tmp_path)!r}
        os.environ[console.VERBOSE_ENV] = "0"
        with console.captured("rank0"):
            mine, theirs = mp.Pipe()
            child = mp.get_context("fork").Process(target=helper, args=(theirs,))
            child.start()
            theirs.close()
            SignalWatcher(on_first=lambda s: print("stop requested", flush=True))
            console.say(f"ready {{child.pid}}")
            try:
                mine.recv()  # EOF once the helper is killed
            except EOFError:
                kill_tree(child.pid)  # what the reward pool does with a dead worker
                raise RuntimeError("the helper died")
    """)
    ready = proc.stderr.readline().split()
    assert ready[0] == "ready", ready
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(10) == 128 + signal.SIGINT
    terminal = proc.stderr.read()
    assert terminal.strip() == "megarl: SIGINT received (a second signal): stopping now", terminal
    log = (tmp_path / "rank0.log").read_text()
    assert "stop requested" in log and "SIGINT received (a second signal): stopping now" in log, log
    assert _gone(int(ready[1]))
