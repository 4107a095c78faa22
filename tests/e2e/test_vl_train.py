"""`megarl train` of a tiny random Qwen2.5-VL (and Qwen3-VL) on image prompts, as a user runs it: a JSONL file of chat
rows whose `<image>` placeholders pair with PNG files drawn with PIL (one coloured shape each; the question asks its
colour), the hf engine sampling with the images, two GRPO steps at TP1 and at TP2. Each step's engine-trainer gap
(the trainer's recomputed logprobs of the sampled tokens against the engine's, rollout/logprob_abs_diff_max) must be
within the float32 bound derived from the model (megarl.numerics.fp32_bound, the vision tower's term included), and
the actor must really update (a non-zero gradient).
"""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers.tiny_vlm import hf_row_logits, make_tiny_vl_model

ROOT = Path(__file__).resolve().parents[2]
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 60), "blue": (40, 60, 220)}
PROMPTS, N, RESPONSE = 6, 4, 6
# The colour named is the answer; a random model never names it, so every reward would be 0 and no weight would
# move: the response's length in characters mod 3 is added so that rewards differ within a group and the steps
# really update.
REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (1.0 if ground_truth in solution_str else 0.0) + (len(solution_str) % 3) / 2
"""


def shapes(folder: Path) -> Path:
    """PROMPTS image rows: a shape of one colour on white, 56 to 84 pixels a side, its colour the answer."""
    from PIL import Image, ImageDraw

    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(PROMPTS):
        name = list(COLOURS)[i % len(COLOURS)]
        size = (56 + 14 * (i % 3), 56 + 14 * ((i + 1) % 3))
        image = Image.new("RGB", size, (255, 255, 255))
        box = [8, 8, size[0] - 8, size[1] - 8]
        (ImageDraw.Draw(image).ellipse if i % 2 else ImageDraw.Draw(image).rectangle)(box, fill=COLOURS[name])
        image.save(folder / f"shape_{i}.png")
        rows.append({"prompt": [{"role": "user", "content": "<image>What colour is the shape?"}],
                     "images": [f"shape_{i}.png"], "data_source": "shapes",
                     "reward_model": {"ground_truth": name}})
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl"])
def setup(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"vl_train_{request.param}")
    model = make_tiny_vl_model(tmp / "model", architecture=request.param)
    data = shapes(tmp / "data")
    (tmp / "reward.py").write_text(REWARD)
    recipe = {
        "model": {"path": str(model)},
        "data": {"train_files": [str(data)], "train_batch_size": PROMPTS},
        "reward": {"reward_fn": str(tmp / "reward.py")},
        "rollout": {"name": "hf", "n": N, "prompt_length": 64, "response_length": RESPONSE, "temperature": 1.0,
                    "log_prob_micro_batch_size_per_gpu": 4},
        "actor": {"ppo_mini_batch_size": PROMPTS, "ppo_micro_batch_size_per_gpu": 4, "use_kl_loss": True,
                  "kl_loss_coef": 0.01, "optim": {"lr": 1e-4}},
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"total_steps": 2, "test_freq": 0, "val_before_train": False, "seed": 1},
        "logging": {"tensorboard": False},
    }
    path = tmp / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return tmp, model, path


def bound(model: Path) -> float:
    """fp32_bound of the tiny model over a step's sampled positions: the logits' RMS from transformers' forward of
    the first image row with a response's worth of text, the longest row, the largest image frame."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from megarl.bridge.hf_config import load_spec
    from megarl.data.dataset import PromptRecord
    from megarl.data.vision import ImagePrompts
    from megarl.numerics import fp32_bound

    tok = AutoTokenizer.from_pretrained(str(model))
    images = ImagePrompts(str(model), tok)
    widest = None
    for i in range(PROMPTS):
        pixels, grid = images.pixels([str(model.parent / "data" / f"shape_{i}.png")])
        if widest is None or int(grid[:, 1:].prod()) > int(widest[1][:, 1:].prod()):
            widest = (i, grid, pixels)
    i, grid, pixels = widest
    record = PromptRecord(index=0, uid="p", prompt=({"role": "user", "content": "<image>What colour is the shape?"},),
                          data_source="shapes", ground_truth="red",
                          images=(str(model.parent / "data" / f"shape_{i}.png"),))
    ids = torch.tensor([images.prompt_ids(record) + tok("red green blue red green blue")["input_ids"][:RESPONSE]])
    hf = AutoModelForImageTextToText.from_pretrained(str(model), dtype=torch.float32)
    logits = hf_row_logits(hf, ids, ids.shape[1] - RESPONSE, pixels, grid)[-RESPONSE - 1:-1]
    return fp32_bound(load_spec(str(model)), ids.shape[1], PROMPTS * N * RESPONSE,
                      float(logits.float().pow(2).mean().sqrt()), vision_segment=int(grid[:, 1:].prod()))


@pytest.mark.slow  # four `megarl train` runs of two GRPO steps, ~23 s apiece on 2 cores
@pytest.mark.parametrize("tp", [1, 2])
def test_megarl_train_grpo_on_image_prompts(setup, tp):
    tmp, model, recipe = setup
    run = tmp / f"tp{tp}"
    proc = subprocess.run([sys.executable, "-m", "megarl", "train", str(recipe), f"trainer.run_dir={run}",
                           f"parallelism.tensor_model_parallel_size={tp}", f"trainer.n_gpus_per_node={tp}"],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    tol = bound(model)
    assert len(rows) == 2
    for row in rows:
        gap = row["rollout/logprob_abs_diff_max"]
        print(f"[measured] {model.parent.name} tp{tp} step {row['step']}: engine-trainer gap {gap:.2e} "
              f"(bound {tol:.2e}), grad_norm {row['actor/grad_norm']:.3e}, reward {row['train/reward_mean']:.2f}")
        assert gap < tol, (gap, tol)
        assert row["actor/grad_norm"] > 0
