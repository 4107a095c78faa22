"""`megarl sft` on image rows of a tiny random Qwen2.5-VL: the first step's loss (the token-mean NLL of the response
tokens, computed by the packed VL forward before the step's update) equals transformers' loss on the same rows with
their images, within the float32 bound derived from the model (megarl.numerics.fp32_bound: a mean of per-token errors
is no larger than their largest). The same rows with their images swapped between two rows of one size must be far
outside that bound: the test sees whether each row gets its own image.
"""
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers.tiny_vlm import hf_row_logits, make_tiny_vl_model, synthetic_image

ROOT = Path(__file__).resolve().parents[2]
# images of two sizes (two grids), the first two of one size; one row text only, packed beside the image rows
SIZES = [(100, 60), (100, 60), (70, 90), None]
RESPONSES = ["red square", "green circle on the left", "blue", "no image here"]


def png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def write_rows(folder: Path) -> Path:
    rows = []
    for i, (size, response) in enumerate(zip(SIZES, RESPONSES)):
        row = {"prompt": [{"role": "user", "content": f"<image>what is shape {i} ?" if size else f"text {i} ?"}],
               "response": response, "data_source": "exact_match", "ground_truth": response}
        if size:
            synthetic_image(*size, i).save(folder / f"image_{i}.png")
            row["images"] = [f"image_{i}.png"]
        rows.append(row)
    path = folder / "sft.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def hf_loss(model_dir: Path, data: Path, swap: bool = False) -> tuple[float, float]:
    """(transformers' token-mean NLL over the rows' response tokens and EOS, the derived fp32 bound); swap: the first
    two rows (one image size) have each other's image."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from megarl.bridge.hf_config import load_spec
    from megarl.data.dataset import load_prompts
    from megarl.data.vision import ImagePrompts
    from megarl.numerics import fp32_bound

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    images = ImagePrompts(str(model_dir), tok)
    model = AutoModelForImageTextToText.from_pretrained(str(model_dir), dtype=torch.float32)
    records = load_prompts([str(data)], setting="sft.train_files", require_ground_truth=False, require_response=True)
    nll, logits_at, longest, frame = [], [], 0, 0
    for i, rec in enumerate(records):
        prompt = images.prompt_ids(rec) if rec.images else tok(tok.apply_chat_template(
            list(rec.prompt), add_generation_prompt=True, tokenize=False), add_special_tokens=False)["input_ids"]
        response = tok(rec.response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        ids = torch.tensor([prompt + response])
        pixels = grid = None
        if rec.images:
            pixels, grid = images.pixels(records[1 - i].images if swap and i < 2 else rec.images)
            frame = max(frame, int(grid[:, 1:].prod(-1).max()))
        logits = hf_row_logits(model, ids, len(prompt), pixels, grid)[len(prompt) - 1:-1]
        nll.append(-torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1))
        logits_at.append(logits)
        longest = max(longest, ids.shape[1])
    nll, logits = torch.cat(nll), torch.cat(logits_at)
    bound = fp32_bound(load_spec(str(model_dir)), longest, nll.numel(), float(logits.pow(2).mean().sqrt()),
                       vision_segment=frame)
    return float(nll.mean()), bound


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vl_sft")
    model = make_tiny_vl_model(tmp / "model")
    data = write_rows(tmp)
    return tmp, model, data


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_sft_loss_on_image_rows_equals_transformers(setup, tp):
    tmp, model, data = setup
    run = tmp / f"tp{tp}"
    recipe = {"model": {"path": str(model)}, "data": {"train_files": [str(data)]},
              "rollout": {"name": "hf", "n": 2},
              "sft": {"enable": True, "train_files": [str(data)], "total_steps": 1, "batch_size": len(SIZES),
                      "max_length": 128, "output_dir": str(run / "sft_model")},
              "actor": {"ppo_micro_batch_size_per_gpu": 2},
              "trainer": {"run_dir": str(run), "seed": 1, "n_gpus_per_node": tp},
              "parallelism": {"tensor_model_parallel_size": tp}, "logging": {"tensorboard": False}}
    path = tmp / f"sft_tp{tp}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = subprocess.run([sys.executable, "-m", "megarl", "sft", str(path)], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    first = json.loads((run / "sft" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    ref, bound = hf_loss(model, data)
    swapped, _ = hf_loss(model, data, swap=True)
    got = first["sft/loss"]
    print(f"[measured] tp{tp}: megarl sft loss {got:.6f}, transformers {ref:.6f} (|diff| {abs(got - ref):.2e}, bound "
          f"{bound:.2e}); with two rows' images swapped {swapped:.6f}")
    assert abs(got - ref) < bound, (got, ref, bound)
    assert abs(swapped - ref) > 10 * bound, (swapped, ref, bound)
    assert (run / "sft_model" / "preprocessor_config.json").exists()  # the RL run's engine reads its images with it
