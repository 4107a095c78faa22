"""megatron-core imported after megarl skips torch's compiler stack on CPU and wandb, and nothing else changes."""
import importlib.util
import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
import megarl
import megatron.core
from megatron.core import jit
from megatron.core.fusions.fused_bias_dropout import bias_dropout_add_fused_train
state = {"fuser": jit.jit_fuser.__name__, "compiled": "torch._inductor.compile_fx" in sys.modules,
         "dynamo": "torch._dynamo" in sys.modules, "wandb_with_megatron": "wandb" in sys.modules,
         "kernel_is_plain_function": type(bias_dropout_add_fused_train).__name__ == "function"}
try:
    import wandb  # after megatron.core: imports as usual
    state["wandb_after"] = hasattr(wandb, "init")
except ImportError:
    state["wandb_after"] = None
print(json.dumps(state))
"""


def _probe() -> dict:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_megatron_imports_without_compiler_stack_or_wandb_on_cpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a CUDA machine megatron keeps torch.compile for its fused kernels")
    state = _probe()
    assert state["fuser"] == "noop_decorator" and state["kernel_is_plain_function"], state
    assert not state["compiled"] and not state["dynamo"], state
    assert not state["wandb_with_megatron"], state
    if importlib.util.find_spec("wandb") is not None:
        assert state["wandb_after"] is True, state  # megarl's own wandb logger still finds it
