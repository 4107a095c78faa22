"""Patches that megarl applies to vLLM take effect whichever is imported first: megarl's worker extension or vLLM's
modules (a user's script importing megarl at the top spawns vLLM workers that import it before vLLM)."""
import json
import subprocess
import sys

import pytest

PROBE = """
import json, sys
FIRST = sys.argv[1]
if FIRST == "megarl":
    import megarl.rollout.vllm.worker_ext
    assert "vllm.model_executor.layers.utils" not in sys.modules
from vllm.model_executor.layers import utils
from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
if FIRST == "vllm":
    import megarl.rollout.vllm.worker_ext
print(json.dumps({"plain": getattr(utils.dispatch_cpu_unquantized_gemm, "_megarl_plain", False),
                  "experts": getattr(CPUUnquantizedExperts.apply, "_megarl_patched", False)}))
"""


@pytest.mark.parametrize("first", ["megarl", "vllm"])
def test_vllm_patches_apply_in_either_import_order(first):
    r = subprocess.run([sys.executable, "-c", PROBE, first], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"plain": True, "experts": True}


def test_refused_import_fails_only_inside_the_block():
    from megarl.import_hooks import refusing_import

    name = "megarl_test_never_imported_module"
    with refusing_import(name, "refused for the test"):
        with pytest.raises(ModuleNotFoundError, match="refused for the test"):
            __import__(name)
    with pytest.raises(ModuleNotFoundError) as err:  # outside: the usual error of a module that does not exist
        __import__(name)
    assert "refused" not in str(err.value)
