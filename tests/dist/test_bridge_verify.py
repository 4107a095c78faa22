"""`megarl verify`: starts its own ranks as a plain command, uses the given ranks under a launcher, exits non-zero
above the tolerance and on a layout the checkpoint cannot take."""
import pytest

from megarl.launch_local import run_ranks
from megarl.verify import main
from tests.helpers.tiny_models import make_tiny_model

# `parity` (the AVX2 tier) marks the tests whose bound depends on rounding;
# the launcher and layout tests check plumbing


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("verify") / "qwen2", seed=7))


@pytest.mark.parity
@pytest.mark.parity_repeat  # the AVX2 tier keeps the bf16 pass below (the same ranks and kernels)
def test_plain_command_starts_ranks_and_fails_above_tolerance(qwen2_dir, capsys):
    code = main(["--hf", qwen2_dir, "--tp", "2", "--seq-len", "32", "--batch", "3", "--tol", "1e-12"])
    out = capsys.readouterr().out
    assert "TP=2 PP=1 EP=1" in out and "batch from tokenizer" in out
    assert "max abs logprob difference" in out and "FAILED" in out
    assert code == 1
    diff = float(out.split("max abs logprob difference ")[1].split()[0])
    from megarl import hf_reference, verify
    from megarl.bridge.hf_config import load_spec
    from megarl.numerics import fp32_bound

    spec = load_spec(qwen2_dir)
    tokens, lengths, _ = verify.make_batch(qwen2_dir, spec.vocab_size, 3, 32)
    hf, stats = hf_reference.hf_logprobs(qwen2_dir, tokens, lengths)
    tol = fp32_bound(spec, 32, int(hf_reference.real_mask(lengths, hf.shape[1]).sum()), stats.rms)
    assert 0 < diff <= tol  # the same run passes at the default (derived) tolerance
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3  # one row per sequence


def verify_under_launcher(argv):
    return main(argv)


def test_under_a_launcher_uses_the_given_ranks(qwen2_dir):
    codes = run_ranks(f"{__name__}:verify_under_launcher", 2,
                      {"argv": ["--hf", qwen2_dir, "--pp", "2", "--seq-len", "24", "--batch", "2"]}, timeout=600)
    assert codes == [0, 0]


def test_bad_layout_is_refused_before_starting_ranks(qwen2_dir, capsys):
    assert main(["--hf", qwen2_dir, "--tp", "3"]) == 2
    assert "tensor_model_parallel_size=3 does not divide num_attention_heads=4" in capsys.readouterr().err


def _corrupt_norm(src, dst):
    """A copy of the checkpoint with one layer's post-attention norm weight reversed: what a bridge that sliced or
    permuted that tensor wrongly would load."""
    import shutil
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for f in Path(dst).glob("*.safetensors"):
        sd = load_file(f)
        key = next((k for k in sd if k.endswith("layers.1.post_attention_layernorm.weight")), None)
        if key:
            sd[key] = sd[key].flip(0).contiguous()
            save_file(sd, f, metadata={"format": "pt"})
            return dst
    raise AssertionError("no norm weight found")


@pytest.mark.parity
@pytest.mark.parity_repeat
def test_bf16_tolerance_catches_a_wrong_mapping_that_the_old_bound_let_pass(tmp_path):
    import torch

    from megarl import hf_reference, verify
    from megarl.bridge.hf_config import load_spec

    good = str(make_tiny_model("qwen3", tmp_path / "qwen3"))
    bad = _corrupt_norm(good, str(tmp_path / "qwen3_bad"))
    tokens, lengths, _ = verify.make_batch(good, load_spec(good).vocab_size, 4, 64)
    hf, stats = hf_reference.hf_logprobs(good, tokens, lengths)  # the reference: the checkpoint's true model
    tol = verify.precision_tolerance(verify.BF16_UNIT, stats.scale)
    got = {}
    for name, d in (("good", good), ("bad", bad)):
        (r,) = run_ranks("megarl.verify:_rank_body", 1, {"hf_dir": d, "tokens": tokens, "dtype": "bfloat16"},
                         timeout=300)
        got[name] = r["megatron"]
    mean = {k: verify.mean_abs_diff(hf, v, lengths) for k, v in got.items()}
    worst = {k: verify.compare(hf, v, lengths)[0] for k, v in got.items()}
    assert mean["good"] <= tol < mean["bad"], (mean, tol)
    assert worst["bad"] < 0.5  # the former bf16 bound (max difference <= 0.5) passed this wrong mapping
    assert torch.isfinite(got["bad"]).all()


@pytest.mark.parity
def test_bf16_verify_passes_with_its_derived_tolerance(qwen2_dir, capsys):
    assert main(["--hf", qwen2_dir, "--dtype", "bfloat16", "--seq-len", "32", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert "x bf16 unit roundoff x logits scale" in out and "OK" in out


@pytest.mark.parity
@pytest.mark.parity_repeat
def test_a_precision_sized_float32_difference_is_not_blamed_on_the_bridge():
    from megarl.verify import TF32_UNIT, diagnose

    scale = 1.0
    tf32_sized = diagnose(max_diff=4e-3, mean_diff=2 * TF32_UNIT * scale, scale=scale, dtype="float32", tf32=True,
                          device="cuda")
    assert "TF32 rounding" in tf32_sized and "NVIDIA_TF32_OVERRIDE=0" in tf32_sized and "bridge" not in tf32_sized
    mapping = diagnose(max_diff=1.0, mean_diff=0.3, scale=scale, dtype="float32", tf32=False)
    assert "maps incorrectly" in mapping


def test_the_diagnosis_names_causes_possible_on_the_cpu(monkeypatch):
    from megarl.verify import TF32_UNIT, diagnose

    monkeypatch.delenv("ONEDNN_DEFAULT_FPMATH_MODE", raising=False)
    plain = diagnose(max_diff=4e-3, mean_diff=2 * TF32_UNIT, scale=1.0, dtype="float32", tf32=False, device="cpu")
    assert "NVIDIA_TF32_OVERRIDE" not in plain and "bf16 / AMX kernel" in plain and "bridge" not in plain
    monkeypatch.setenv("ONEDNN_DEFAULT_FPMATH_MODE", "BF16")
    switched = diagnose(max_diff=4e-3, mean_diff=2 * TF32_UNIT, scale=1.0, dtype="float32", tf32=False, device="cpu")
    assert "ONEDNN_DEFAULT_FPMATH_MODE=BF16" in switched
