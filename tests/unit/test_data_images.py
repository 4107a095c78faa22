"""Image prompts (verl's multimodal rows): each bad row is refused by megarl validate with its file, row and reason,
good rows (bytes, {bytes, path} structs, relative paths) load with their images kept, and images beside a text-only
model are refused."""
import io
import json

import pytest
from PIL import Image

from megarl.config.issues import ConfigError
from megarl.data import load_prompts
from megarl.data.images import placeholders, row_image_problem
from megarl.validate import load_config

RECIPE = "recipes/grpo_tiny_cpu.yaml"


def png(colour=(255, 0, 0)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 6), colour).save(out, format="PNG")
    return out.getvalue()


def row(content: str, images, truth="3") -> dict:
    return {"prompt": [{"role": "user", "content": content}], "images": images, "data_source": "shapes",
            "ground_truth": truth}


def write(tmp_path, rows, name="train.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_placeholders_count_every_message():
    assert placeholders([{"role": "system", "content": "<image>"}, {"role": "user", "content": "a <image> b <image>"}]) \
        == 3
    assert placeholders("no image here") == 0


@pytest.mark.parametrize("images, content, reason", [
    (["missing.png"], "<image>How many?", "image file"),
    (["broken.png"], "<image>How many?", "is not a decodable image"),
    (["good.png"], "<image><image>How many?", "2 <image> placeholder(s) and the row 1 image(s) (more placeholders"),
    (["good.png", "good.png"], "<image>How many?", "(fewer placeholders than images)"),
    ([7], "<image>How many?", "image 0 is neither encoded bytes nor a path"),
    ("good.png", "<image>How many?", "must be a list of images"),
])
def test_each_bad_row_is_named_with_its_reason(tmp_path, images, content, reason):
    (tmp_path / "good.png").write_bytes(png())
    (tmp_path / "broken.png").write_bytes(b"\x89PNG not really")
    problem = row_image_problem([{"role": "user", "content": content}], images, str(tmp_path))
    assert problem is not None and reason in problem, problem


def test_validate_refuses_the_file_naming_each_bad_row(tmp_path):
    (tmp_path / "good.png").write_bytes(png())
    rows = [row("<image>How many?", ["good.png"]), row("<image>How many?", ["missing.png"]),
            row("<image><image>How many?", ["good.png"])]
    path = write(tmp_path, rows)
    with pytest.raises(ConfigError) as refused:
        load_config(RECIPE, [f"data.train_files=[{path}]", "data.val_files=[]", f"model.path={tmp_path / 'm'}"])
    text = str(refused.value)
    assert "data.train_files[0]" in text and "2 of 3 image row(s) cannot be used" in text
    assert "row 1: image file" in text and "missing.png does not exist" in text
    assert "row 2: the prompt has 2 <image> placeholder(s)" in text and "config-image-rows" in text


def test_good_rows_load_with_their_images(tmp_path):
    (tmp_path / "figs").mkdir()
    (tmp_path / "figs" / "a.png").write_bytes(png())
    raw = png((0, 0, 255))
    path = tmp_path / "train.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist([
        row("<image>How many?", [{"bytes": raw, "path": None}]),
        row("<image> and <image>: how many?", [{"bytes": None, "path": "figs/a.png"}, {"bytes": raw, "path": None}]),
        row("no image", None)]), path)
    records = load_prompts([str(path)])
    assert records[0].images == (raw,)
    assert records[1].images == (str(tmp_path / "figs" / "a.png"), raw)
    assert records[2].images == ()


def test_images_beside_a_text_only_model_are_refused(tmp_path):
    (tmp_path / "good.png").write_bytes(png())
    path = write(tmp_path, [row("<image>How many?", ["good.png"])])
    model = tmp_path / "text_model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 128,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "tie_word_embeddings": False}))
    with pytest.raises(ConfigError, match=r"1 row\(s\) have images .* the model \(LlamaForCausalLM\) reads text only"):
        load_config(RECIPE, [f"data.train_files=[{path}]", "data.val_files=[]", f"model.path={model}"])
