"""Qwen3-VL (dense): HF -> megarl (TP1, TP2, PP2, TP2 x PP2 over gloo) -> logprobs equal HF transformers'
Qwen3VLForConditionalGeneration within the float32 bound derived from the model's widths and depth (the vision tower
and its DeepStack features included), and HF -> megarl -> export is bitwise the input checkpoint (TP2, PP2, TP2 x PP2;
a tied-embedding variant at TP2 and the tower's gradients at TP2 in the slow tier); `megarl verify` on it at TP2 x PP2.

The same comparisons as Qwen2.5-VL's (tests/dist/test_bridge_qwen2_5_vl.py, whose rank body they share): the language
model alone (placeholders keep their token embeddings, interleaved M-RoPE positions) and the whole model (image
embeddings on the placeholders, DeepStack features added after language-model layers 0 and 1). At TP1 the comparison
fails where it must: 1D positions, one image's height positions off by one, the image placeholders shifted by one,
the DeepStack features left out, megatron's contiguous M-RoPE sections instead of the interleaved ones.
PP2 puts layers 0 and 1 (the DeepStack layers) on the first stage with the vision tower.
"""
import pytest

from tests.dist.test_bridge_qwen2_5_vl import _run, assert_tower_gradients_match, assert_wrong_inputs_fail, vl_case
from tests.helpers.tiny_vlm import make_tiny_vl_model

pytestmark = pytest.mark.parity


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return vl_case(str(make_tiny_vl_model(tmp_path_factory.mktemp("vl") / "qwen3_vl", seed=4,
                                          architecture="qwen3_vl")))


def test_qwen3_vl_parity_tp1_and_wrong_inputs_fail(vl):
    assert_wrong_inputs_fail(_run(vl, 1, negatives=True, export=False, name="qwen3_vl"), vl[2], "qwen3_vl",
                             extra=("without_deepstack", "contiguous_mrope"))


def test_qwen3_vl_parity_tp2_and_export_round_trip(vl):
    _run(vl, 2, negatives=False, export=True, name="qwen3_vl")


def test_qwen3_vl_parity_pp2_and_export_round_trip(vl):
    _run(vl, 1, negatives=False, export=True, pp=2, name="qwen3_vl")


@pytest.mark.parity_repeat  # the kernels of tp2 and pp2
def test_qwen3_vl_parity_tp2pp2_and_export_round_trip(vl):
    _run(vl, 2, negatives=False, export=True, pp=2, name="qwen3_vl")


@pytest.mark.slow
def test_qwen3_vl_tied_embeddings_parity_tp2_and_export_round_trip(tmp_path):
    """Qwen3-VL-2B/4B's shape: the LM head tied to the embedding (no lm_head.weight in the checkpoint)."""
    from megarl.bridge.hf_config import load_spec
    from tests.helpers.tiny_models import read_checkpoint

    hf_dir = str(make_tiny_vl_model(tmp_path / "tied", seed=5, architecture="qwen3_vl", tie_word_embeddings=True))
    assert load_spec(hf_dir).tie_word_embeddings and "lm_head.weight" not in read_checkpoint(hf_dir)
    _run(vl_case(hf_dir, seed=6), 2, negatives=False, export=True, name="qwen3_vl tied")


def test_megarl_verify_on_a_qwen3_vl_checkpoint_tp2_pp2(vl, capsys):
    """`megarl verify` draws its own images through the checkpoint's 16-pixel-patch image processor and judges
    against transformers with the derived bound."""
    from megarl.verify import main

    assert main(["--hf", vl[0], "--tp", "2", "--pp", "2", "--batch", "3", "--seq-len", "48"]) == 0
    out = capsys.readouterr().out
    assert "synthetic images (merged grids [[1, 2, 3], [1, 3, 3], [1, 4, 2]])" in out and "): OK" in out, out


@pytest.mark.slow
def test_qwen3_vl_tower_gradients_at_tp2_equal_transformers(vl):
    """Through the DeepStack hooks too: the DeepStack mergers' gradients come only from the first layers."""
    assert_tower_gradients_match(vl, "qwen3_vl")
