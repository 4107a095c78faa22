"""A synthetic image task for a tiny vision-language model (the Qwen2.5-VL CPU demo): count the shapes of one colour.

    image         112 x 112 pixels, white, a 4 x 4 grid of 28-pixel cells; 1 to 6 cells hold a red, green or blue
                  circle, square or triangle
    prompt        [{"role": "user", "content": "How many red shapes ? <image>"}]
    response      "#### 2"
    ground_truth  "2", data_source "shapes" (scored by the `arithmetic` rule: the response's one '#### N')

A cell is one merged token of a Qwen2.5-VL tower (2 x 2 patches of 14 pixels), and the image processor keeps 112 x 112
as it is, so each shape sits in exactly one of the image's 16 tokens: the answer is a count of tokens with a colour
(whether the tiny model learns it is not shown yet: recipes/grpo_qwen2_5_vl_tiny_cpu.yaml). The colour asked is drawn
independently of the image, so about 30% of the answers are 0 and 38% are 1. The question comes before the image: in causal order the image's tokens can then read the colour
asked, so a layer can mark the cells that match it and the next count the marks (with the image first, only the
answer position sees both). The tokenizer is the synthetic tasks' word-level one with the four vision tokens of
Qwen2.5-VL (VISION_TOKENS); the image processor is transformers' Qwen2-VL one at the tiny tower's sizes.
"""
from __future__ import annotations

import io
import random
from typing import Any

from megarl.data.synthetic import ROLE_TOKENS, SPECIAL_TOKENS, word_level_tokenizer

DATA_SOURCE = "shapes"
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220)}
KINDS = ("circle", "square", "triangle")
GRID, CELL = 4, 28  # cells a side, pixels a cell: one merged token of 2 x 2 patches of 14 pixels
SIDE = GRID * CELL
MAX_SHAPES = 6
PATCH, MERGE = 14, 2
WORDS = ["How", "many", "shapes", "?", "####", *COLOURS]


# Qwen2.5-VL's vision tokens: start, end, image, video (the order of megarl.bridge.tiny.TINY_VL_SPECIAL_TOKENS, which
# the tiny model's config takes their ids in; data sits below the bridge, so the names are written here too)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def vision_tokens() -> list[str]:
    return list(VISION_TOKENS)


def shapes_vocab() -> list[str]:
    """Token strings in id order: specials (<pad>=0, <s>=1, </s>=2, <unk>=3), role markers, the vision tokens
    (start, end, image, video), words, the counts 0 to MAX_SHAPES."""
    return (list(SPECIAL_TOKENS.values()) + ROLE_TOKENS + vision_tokens() + WORDS
            + [str(n) for n in range(MAX_SHAPES + 1)])


def draw(cells: list[tuple[int, str, str]]) -> bytes:
    """PNG bytes of the image with a shape in each (cell index 0..15, colour, kind); a shape fills its cell less a
    4-pixel margin."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (SIDE, SIDE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for cell, colour, kind in cells:
        x, y, m = (cell % GRID) * CELL, (cell // GRID) * CELL, 4
        box = [x + m, y + m, x + CELL - m - 1, y + CELL - m - 1]
        fill = COLOURS[colour]
        if kind == "circle":
            pen.ellipse(box, fill=fill)
        elif kind == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(box[0], box[3]), (box[2], box[3]), ((box[0] + box[2]) // 2, box[1])], fill=fill)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def make_shapes_dataset(n: int, seed: int, split: str = "train") -> list[dict[str, Any]]:
    """n rows of "How many <colour> shapes ?" about an image of 1 to MAX_SHAPES shapes in distinct cells, each of a
    uniform colour and kind; the colour asked is uniform too. Rows in verl's image shape: `images` holds the PNG's
    bytes, the prompt's `<image>` marks where its tokens go. Reproducible from seed."""
    rng = random.Random(f"megarl-shapes:{seed}")
    rows = []
    for i in range(n):
        count = rng.randint(1, MAX_SHAPES)
        cells = [(c, rng.choice(list(COLOURS)), rng.choice(KINDS)) for c in rng.sample(range(GRID * GRID), count)]
        asked = rng.choice(list(COLOURS))
        answer = sum(colour == asked for _, colour, _ in cells)
        rows.append({"data_source": DATA_SOURCE,
                     "prompt": [{"role": "user", "content": f"How many {asked} shapes ? <image>"}],
                     "images": [draw(cells)], "response": f"#### {answer}", "ground_truth": str(answer),
                     "extra_info": {"index": i, "split": split, "colour": asked, "shapes": count}})
    return rows


def shapes_tokenizer(save_dir: str):
    """Build, save and return the task's tokenizer (with the synthetic tasks' chat template) in save_dir."""
    return word_level_tokenizer(save_dir, shapes_vocab())


def shapes_image_processor():
    """transformers' Qwen2-VL image processor (the PIL one) that keeps a SIDE x SIDE image as it is: 16 merged tokens
    (at least 4, at most 16 for other images)."""
    from transformers import Qwen2VLImageProcessorPil

    cell = (PATCH * MERGE) ** 2
    return Qwen2VLImageProcessorPil(min_pixels=4 * cell, max_pixels=GRID * GRID * cell, patch_size=PATCH,
                                    temporal_patch_size=2, merge_size=MERGE)
