"""megarl.distributed.reuse_freed_host_memory: freed large host blocks stay in the process for the next allocation
(instead of going back to the kernel and being faulted in again), and MEGARL_HOST_MALLOC=default leaves malloc alone.

Each case runs in a fresh interpreter: malloc's settings are per process and would otherwise outlive the test."""
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt's parameters are glibc's")

# Allocate and touch 256 MiB (far above glibc's largest mmap threshold, 32 MiB), free it, and print how much of it
# the process still holds: resident pages before the allocation, after touching it, after freeing it.
PROBE = r"""
import os, sys
import torch
from megarl import distributed
print("set", distributed.reuse_freed_host_memory())
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
before = rss()
x = torch.ones(64 * 1024 * 1024)  # 256 MiB of float32, every page written
touched = rss()
del x
freed = rss()
print("held", (freed - before) / (touched - before))
"""


def _probe(**env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=dict(os.environ, **env), capture_output=True, text=True,
                         timeout=120, check=True).stdout
    return dict(line.split(" ", 1) for line in out.splitlines())


def test_freed_large_block_stays_with_the_process():
    got = _probe(MEGARL_HOST_MALLOC="")
    assert got["set"] == "True"
    # kept: all of the 256 MiB is still resident after `del` (the heap keeps up to 2 GiB free at its top)
    assert float(got["held"]) > 0.9


def test_default_leaves_malloc_returning_large_blocks():
    got = _probe(MEGARL_HOST_MALLOC="default")
    assert got["set"] == "False"
    # glibc's own behaviour: the block was an mmap and went back to the kernel on free
    assert float(got["held"]) < 0.1
