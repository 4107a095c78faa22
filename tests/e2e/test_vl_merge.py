"""A Qwen2.5-VL or Qwen3-VL checkpoint through the commands a user runs: `megarl import --tp 2` -> `megarl merge`
writes every tensor bitwise as the original checkpoint holds it (vision tower included), with the image processor's
files beside the tokenizer's, and transformers loads the merged directory and answers as the original does (the same
greedy tokens and logits on text around images); `merge --verify` on it says which command compares a
vision-language model.
"""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.tiny_vlm import hf_vl_logits, make_tiny_vl_model, synthetic_image, vl_batch

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two CLI launches (2 import ranks) and two transformers loads


def _megarl(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "megarl.cli", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def _tensors(hf_dir: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("architecture", ["qwen2_5_vl", "qwen3_vl"])
def test_import_tp2_merge_is_bitwise_and_transformers_answers_the_same(tmp_path, architecture):
    hf = make_tiny_vl_model(tmp_path / "hf", architecture=architecture)
    done = _megarl("import", "--hf", hf, "--out", tmp_path / "ck", "--tp", 2)
    assert done.returncode == 0, done.stderr[-3000:]
    done = _megarl("merge", "--ckpt", tmp_path / "ck" / "checkpoints" / "step_0", "--out", tmp_path / "merged",
                   "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    merged = tmp_path / "merged"
    original, written = _tensors(Path(hf)), _tensors(merged)
    assert sorted(written) == sorted(original) and any(k.startswith("visual.") or ".visual." in k for k in written)
    unequal = [k for k in original if not torch.equal(original[k], written[k])]
    assert not unequal, unequal[:5]
    assert (merged / "preprocessor_config.json").is_file()  # the image processor's, read beside the tokenizer's

    from transformers import AutoImageProcessor, AutoTokenizer

    # the merged directory carries its own image processor and tokenizer (the video processor needs torchvision,
    # which the CPU environment leaves out)
    assert AutoImageProcessor.from_pretrained(str(merged), use_fast=False).to_dict() == \
        AutoImageProcessor.from_pretrained(str(hf), use_fast=False).to_dict()
    assert len(AutoTokenizer.from_pretrained(str(merged))) == len(AutoTokenizer.from_pretrained(str(hf)))
    batch = vl_batch(merged, [synthetic_image(100, 60, 0), synthetic_image(70, 130, 1)])
    # the same weights in the same float32 kernels: the logits are bitwise the original's
    assert torch.equal(hf_vl_logits(merged, batch), hf_vl_logits(hf, batch))
    from transformers import AutoModelForImageTextToText

    answers = []
    for d in (hf, merged):
        model = AutoModelForImageTextToText.from_pretrained(str(d), dtype=torch.float32,
                                                            attn_implementation="eager").eval()
        assert model.config.architectures == [{"qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
                                               "qwen3_vl": "Qwen3VLForConditionalGeneration"}[architecture]]
        with torch.no_grad():
            answers.append(model.generate(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"],
                                          image_grid_thw=batch["image_grid_thw"],
                                          mm_token_type_ids=batch["mm_token_type_ids"], max_new_tokens=8,
                                          do_sample=False))
    assert torch.equal(answers[0], answers[1]) and answers[0].shape[1] > batch["input_ids"].shape[1]

    verify = _megarl("merge", "--ckpt", tmp_path / "ck" / "checkpoints" / "step_0", "--out", tmp_path / "again",
                     "--verify", "--no-progress")
    assert verify.returncode == 1 and "Traceback" not in verify.stderr
    assert "vision-language model" in verify.stderr and "megarl verify --hf" in verify.stderr
