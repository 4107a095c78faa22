"""The synthetic image task (data.synthetic.task: shapes) and the tiny Qwen2.5-VL model.create_tiny makes for it:
each row's answer is what its image shows (counted from the decoded pixels), every image is 16 merged tokens, one per
grid cell; the created model, tokenizer and image processor encode a row with its placeholder run and run in
transformers; validate reads the same shape before the model exists, takes the recipe, and refuses a text task with a
vision-language tiny model (and the reverse) and the vLLM engine for it."""
import dataclasses
import io
from collections import Counter

import pytest
import torch
from PIL import Image

from megarl.config.issues import ConfigError
from megarl.data.synthetic_shapes import CELL, COLOURS, GRID, make_shapes_dataset, shapes_image_processor
from megarl.validate import load_config

RECIPE = "recipes/grpo_qwen2_5_vl_tiny_cpu.yaml"


def cell_colours(png: bytes) -> list:
    """The colour name of each grid cell's centre pixel, None for white (the image read back, not the generator's
    list)."""
    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = []
    for cell in range(GRID * GRID):
        x, y = (cell % GRID) * CELL + CELL // 2, (cell // GRID) * CELL + CELL // 2 + 3  # inside a triangle too
        pixel = image.getpixel((x, y))
        out.append(next((name for name, rgb in COLOURS.items() if rgb == pixel), None))
    return out


def test_each_answer_is_the_count_the_image_shows():
    rows = make_shapes_dataset(200, seed=3)
    answers = Counter()
    for row in rows:
        colours = cell_colours(row["images"][0])
        asked = next(w for w in row["prompt"][0]["content"].split() if w in COLOURS)
        assert row["response"] == f"#### {row['ground_truth']}"
        assert int(row["ground_truth"]) == colours.count(asked), (colours, row["prompt"])
        assert 1 <= sum(c is not None for c in colours) <= 6
        answers[row["ground_truth"]] += 1
    assert set(answers) >= {"0", "1", "2", "3"}  # the counts vary, 0 included
    assert make_shapes_dataset(5, seed=3)[0]["images"] == rows[0]["images"]  # reproducible from the seed


def test_every_image_is_one_merged_token_per_cell():
    rows = make_shapes_dataset(4, seed=1)
    out = shapes_image_processor()(images=[Image.open(io.BytesIO(r["images"][0])).convert("RGB") for r in rows],
                                   return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 2 * GRID, 2 * GRID]] * 4  # 8 x 8 patches: 4 x 4 merged tokens


def test_created_tiny_vl_model_encodes_and_runs_a_row(tmp_path):
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from megarl.bridge.hf_config import spec_from_dict, load_spec
    from megarl.bridge.tiny import tiny_hf_config
    from megarl.config.schema import TinyModelSpec
    from megarl.data.dataset import records_from_rows
    from megarl.bridge.tiny import TINY_VL_SPECIAL_TOKENS
    from megarl.data.synthetic_shapes import shapes_vocab, vision_tokens
    from megarl.data.vision import ImagePrompts
    from megarl.prepare import create_tiny_model

    spec = TinyModelSpec(architecture="qwen2_5_vl", tie_word_embeddings=False)
    path = create_tiny_model(spec, tmp_path / "model", seed=1, task="shapes")
    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32)
    assert tok.convert_ids_to_tokens(model.config.image_token_id) == "<|image_pad|>"
    assert tuple(vision_tokens()) == TINY_VL_SPECIAL_TOKENS
    [record] = records_from_rows(make_shapes_dataset(1, seed=2), "shapes", require_response=True)
    images = ImagePrompts(str(path), tok)
    ids = images.prompt_ids(record)
    assert ids.count(model.config.image_token_id) == GRID * GRID
    assert tok.unk_token_id not in ids
    pixels, grid = images.pixels(record.images)
    types = torch.tensor([[int(i == model.config.image_token_id) for i in ids]])
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids]), pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=types).logits
    assert logits.shape == (1, len(ids), len(shapes_vocab())) and torch.isfinite(logits).all()
    # validate's view of the model before it exists is the made model's (the vision token ids aside: the shape only)
    ids_off = {k: 0 for k in ("image_token_id", "video_token_id", "vision_start_token_id")}

    def shape(s):
        return dataclasses.replace(s, vision=dataclasses.replace(s.vision, **ids_off))

    assert shape(spec_from_dict(tiny_hf_config(spec, len(shapes_vocab())).to_dict(), "tiny")) == \
        shape(load_spec(str(path)))


def test_the_recipe_validates(tmp_path):
    cfg = load_config(RECIPE, [f"trainer.run_dir={tmp_path}", f"model.path={tmp_path}/init_model"])
    assert cfg.model.create_tiny.architecture == "qwen2_5_vl" and cfg.sft.enable and cfg.rollout.name == "hf"


@pytest.mark.parametrize("overrides,key", [
    (["data.synthetic.task=arithmetic"], "model.create_tiny.architecture"),
    (["model.create_tiny.architecture=llama"], "model.create_tiny.architecture"),
    (["rollout.name=vllm"], "rollout.name"),
])
def test_mismatched_task_or_engine_is_refused(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, [f"trainer.run_dir={tmp_path}", f"model.path={tmp_path}/init_model"] + overrides)
    assert key in str(e.value) and "Traceback" not in str(e.value), str(e.value)
