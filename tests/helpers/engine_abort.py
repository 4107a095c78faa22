"""Abort a running generate deterministically: a second thread raises the engine's abort while its Nth engine step
runs, exactly as a trainer thread would while the engine is busy."""
from __future__ import annotations

import threading
import time


def generate_aborted_at_step(engine, at_step: int, *args, **kwargs):
    """engine.generate(*args, **kwargs) on an in-process VLLMEngine, aborted from another thread during step
    `at_step`; returns the partial RolloutBatch."""
    core, steps = engine._driver._engine, [0]
    step, reached = core.step, threading.Event()

    def counting_step():
        steps[0] += 1
        if steps[0] == at_step:
            reached.set()
            time.sleep(0.2)  # the other thread's abort lands while this step is still running
        return step()

    core.step = counting_step
    aborter = threading.Thread(target=lambda: (reached.wait(60), engine.abort()))
    aborter.start()
    try:
        return engine.generate(*args, **kwargs)
    finally:
        aborter.join()
        core.step = step
