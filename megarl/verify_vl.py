"""`megarl verify --hf DIR` on a vision-language checkpoint (Qwen2.5-VL): the batch and the rank body of logprob parity
of megarl's megatron model with HF transformers on text around images (megarl.verify judges).

The batch: one synthetic image per row (filled rectangles and ellipses on a plain background, a different size per
row, drawn with PIL from --seed) turned into patches by the checkpoint's own image processor
(preprocessor_config.json), its placeholder run (<|vision_start|> <|image_pad|> x merged tokens <|vision_end|>)
placed among the checkpoint tokenizer's encoding of verify's sample texts; every row --seq-len tokens, no padding.
megarl computes the logprobs at the given TP / PP (megarl.megatron.vlm.vl_logits: the vision tower on the first
stage, M-RoPE positions from megarl's own computation), transformers computes them with its
AutoModelForImageTextToText; the float32 tolerance is megarl.numerics.fp32_bound with the vision tower's rounding
(its depth, widths and the largest image's patch count) added to the language model's.
"""
from __future__ import annotations

import random

import torch

from megarl.bridge.hf_config import ArchSpec, BridgeError

# image sizes in pixels (width, height) of the rows, in turn: merged grids differ, windows are cut short at edges
SIZES = ((100, 60), (84, 84), (70, 130), (130, 70))


def synthetic_image(width: int, height: int, seed: int = 0):
    """A PIL RGB image: four filled rectangles or ellipses in random colours at random places on a random background."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    img = Image.new("RGB", (width, height), tuple(rng.randrange(256) for _ in range(3)))
    draw = ImageDraw.Draw(img)
    for _ in range(4):
        x0, y0 = rng.randrange(width - 4), rng.randrange(height - 4)
        box = [x0, y0, rng.randrange(x0 + 3, width), rng.randrange(y0 + 3, height)]
        (draw.rectangle if rng.random() < 0.5 else draw.ellipse)(box, fill=tuple(rng.randrange(256) for _ in range(3)))
    return img


def make_vl_batch(hf_dir: str, spec: ArchSpec, texts: list, batch: int, seq_len: int, seed: int = 0) -> dict:
    """{"tokens" [B, S], "pixel_values", "image_grid_thw" [B, 3]} with the tokenizer's encoding of `texts` around the
    images (module docstring); BridgeError naming what is missing (tokenizer, image processor, the vision tokens) or
    the --seq-len the images need."""
    from transformers import AutoImageProcessor, AutoTokenizer

    v = spec.vision
    try:
        tok = AutoTokenizer.from_pretrained(hf_dir)
        processor = AutoImageProcessor.from_pretrained(hf_dir)
    except (OSError, ValueError) as exc:
        raise BridgeError(f"{hf_dir}: verifying a vision-language model needs its tokenizer and image processor "
                          f"(tokenizer files, preprocessor_config.json): {exc}") from None
    end_id = tok.convert_tokens_to_ids("<|vision_end|>")
    ids = {"<|vision_start|>": v.vision_start_token_id, "<|image_pad|>": v.image_token_id}
    for text, want in ids.items():
        if tok.convert_tokens_to_ids(text) != want:
            raise BridgeError(f"{hf_dir}: the tokenizer's {text} is id {tok.convert_tokens_to_ids(text)} but "
                              f"config.json says {want}")
    images = [synthetic_image(*SIZES[i % len(SIZES)], seed * 1000 + i) for i in range(batch)]
    processed = processor(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"].long()
    text: list = []
    j = 0
    while len(text) < seq_len:
        text += tok(texts[j % len(texts)] + " ", add_special_tokens=False)["input_ids"]
        j += 1
    counts = [t * h * w // v.merge_unit for t, h, w in grid.tolist()]
    if seq_len < max(counts) + 4:  # the placeholder run, its start and end tokens, and text on both sides
        raise BridgeError(f"--seq-len {seq_len} is too short for the batch's images (the largest gives {max(counts)} "
                          f"merged tokens); use --seq-len {max(counts) + 4} or more")
    rows = []
    for i, n in enumerate(counts):
        free = seq_len - n - 2
        before = 1 + (i * 7) % (free - 1)
        rows.append(text[i:i + before] + [v.vision_start_token_id] + [v.image_token_id] * n + [end_id]
                    + text[i + before:i + free])
    tokens = torch.tensor(rows)
    if int(tokens.max()) >= spec.vocab_size:
        raise BridgeError(f"{hf_dir}: the tokenizer produces id {int(tokens.max())} >= vocab_size={spec.vocab_size}")
    return {"tokens": tokens, "pixel_values": processed["pixel_values"].float(), "image_grid_thw": grid}


def rank_body(hf_dir: str, batch: dict, tp: int, pp: int, seed: int, first_stage=None, last_stage=None) -> dict:
    """megarl's logprobs [B, S-1] on TP rank 0 of the last stage (DP rank 0), None elsewhere."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.precision import apply_precision
    from megarl.megatron.vlm import vl_logits

    apply_precision(allow_tf32=False)
    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               num_layers_in_first_pipeline_stage=first_stage,
                               num_layers_in_last_pipeline_stage=last_stage), seed=seed)
    model, spec = build_and_load(hf_dir, dtype=torch.float32)
    model.eval()
    tokens = batch["tokens"]
    with torch.no_grad():
        local = vl_logits(model, tokens, batch["pixel_values"], batch["image_grid_thw"])
        if local is None:
            return {"megatron": None}
        logits = gather_from_tensor_model_parallel_region(local)[..., : spec.vocab_size].float().cpu()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    report = ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0
    return {"megatron": lp if report else None}
