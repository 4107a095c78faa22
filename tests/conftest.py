import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Rank subprocesses import test modules by name (tests.dist.test_x): they need the repo root on their path.
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# What nearly every rank of a multi-rank test imports, ~3-5 s a rank on 2 cores (megarl.launch_local.fork_ranks_from).
RANK_PRELOAD = ["megarl", "torch.distributed", "megatron.core", "transformers", "megarl.launch_local",
                "megarl.megatron.workers", "megarl.trainer", "transformers.models.llama.modeling_llama"]


def pytest_sessionstart(session):
    # About a hundred rank groups start in the default suite: fork them from one server that imported their common
    # modules once (it imports them while the tests are collected). MEGARL_TEST_FRESH_RANKS=1 starts every rank as a
    # fresh interpreter, as `megarl` itself does; so does a CUDA machine (a process that asked CUDA for its devices is
    # no safe parent of ranks that use it).
    import torch

    if os.environ.get("MEGARL_TEST_FRESH_RANKS") != "1" and not torch.cuda.is_available():
        from megarl import launch_local

        # megatron warns at import that TE is absent; pytest.ini hides it in tests, this hides it from the server
        launch_local.fork_ranks_from(RANK_PRELOAD, start_now=True, server_env={
            "PYTHONWARNINGS": "ignore:Transformer Engine and Apex are not installed"})


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `make test-gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
