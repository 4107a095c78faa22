"""Context parallelism (megarl.megatron.context_parallel) on real megatron-core over gloo, without Transformer Engine.

- Logprobs at CP2 of rows of very different lengths (2 to 40 tokens, each padded to a multiple of 2*CP = 4 and split
  into 4 load-balanced chunks) equal HF transformers' on the padded rows within the derived float32 bound
  (tests/helpers/bounds.py, what `megarl verify` uses): dense with QK norm (qwen3), MLA with YaRN rope
  (deepseek_v3), MoE at CP2 x EP2 (experts spread over the CP ranks), and (slow) CP2 x TP2 with sequence
  parallelism, CP2 x PP2, CP2 x PP2 x VPP2.
- One PPO update at CP2 equals the same update at CP1: loss, grad norm and every parameter within the bounds derived
  in tests.helpers.bounds.assert_same_ppo_step. That is the gradient bookkeeping: megatron multiplies each loss by CP
  and averages gradients over DP x CP, megarl's per-token gather keeps each rank's own tokens' gradient, and the
  gathered keys and values send every rank's gradient back to the rank that holds them.
"""
import pytest
import torch

from megarl.launch_local import run_ranks
from tests.dist.test_packing import LR, _batch, check_equal_hf, tiny_models
from tests.helpers.bounds import assert_same_ppo_step
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models(tmp_path_factory.mktemp("cp"), ("qwen3", "qwen3_moe", "deepseek_v3"))


SLOW = pytest.mark.slow  # four ranks on two cores: a minute or more each
# (id, cp, tp, pp, ep, vpp, sequence_parallel, micro-batch rows, architectures)
LAYOUTS = [
    ("cp2", 2, 1, 1, 1, None, None, 4, ("qwen3", "deepseek_v3")),
    # the AVX2 tier (parity_repeat: left out there) runs the cp2 case's kernels; this one adds the expert dispatch
    pytest.param("cp2_ep2", 2, 1, 1, 2, None, None, 4, ("qwen3_moe",), marks=pytest.mark.parity_repeat, id="cp2_ep2"),
    pytest.param("cp2_tp2_sp", 2, 2, 1, 1, None, True, 4, ("qwen3",), marks=SLOW, id="cp2_tp2_sp"),
    pytest.param("cp2_pp2", 2, 1, 2, 1, None, None, 2, ("qwen3",), marks=SLOW, id="cp2_pp2"),
    pytest.param("cp2_pp2_vpp2", 2, 1, 2, 1, 2, None, 2, ("qwen3",), marks=SLOW, id="cp2_pp2_vpp2"),
]


@pytest.mark.parametrize("name,cp,tp,pp,ep,vpp,sp,micro,archs", LAYOUTS,
                         ids=[x[0] if isinstance(x, tuple) else x.id for x in LAYOUTS])
def test_context_parallel_logprobs_equal_hf(tiny, name, cp, tp, pp, ep, vpp, sp, micro, archs):
    models, tokens, lengths, mask, refs = tiny
    results = run_ranks("tests.dist.test_packing:packed_rank", tp * pp * max(cp, ep),
                        {"models": {a: models[a] for a in archs}, "tokens": tokens, "lengths": lengths, "cp": cp,
                         "tp": tp, "pp": pp, "ep": ep, "vpp": vpp, "sequence_parallel": sp, "micro": micro},
                        timeout=600)
    # every CP rank of the last stage returns the whole rows
    assert check_equal_hf(results, refs, mask, f"{name} CP") >= len(archs) * cp


@pytest.mark.parity_repeat  # CP2 against CP1 on the same kernels: the AVX2 tier's actor-step tests cover the update
def test_cp2_step_equals_cp1_step(tmp_path):
    hf_dir = str(make_tiny_model("qwen3", tmp_path / "qwen3", seed=2))
    batch = _batch(hf_dir)
    cp1, cp2 = (run_ranks("tests.dist.test_packing:step_rank", cp, {"hf_dir": hf_dir, "batch": batch, "tp": 1,
                                                                    "padded": False, "cp": cp}, timeout=420)
                for cp in (1, 2))
    # both CP ranks hold the whole (replicated) model after the step: each is compared with the CP1 run
    assert_same_ppo_step("cp2 vs cp1", hf_dir, batch, cp2, cp1 * 2, LR)
