"""`megarl verify --hf DIR` on a vision-language checkpoint (Qwen2.5-VL): logprob parity of megarl's megatron model
with HF transformers on text around images.

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

import os
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


def make_vl_batch(hf_dir: str, spec: ArchSpec, batch: int, seq_len: int, seed: int = 0) -> dict:
    """{"tokens" [B, S], "pixel_values", "image_grid_thw" [B, 3]} (module docstring); BridgeError naming what is
    missing (tokenizer, image processor, the vision tokens) or the --seq-len an image needs."""
    from transformers import AutoImageProcessor, AutoTokenizer

    from megarl.verify import TEXTS

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
        text += tok(TEXTS[j % len(TEXTS)] + " ", add_special_tokens=False)["input_ids"]
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


def _rank_body(hf_dir: str, batch: dict, tp: int, pp: int, seed: int, first_stage=None, last_stage=None) -> dict:
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


def main_vl(args, spec: ArchSpec) -> int:
    """verify's path for a vision-language spec (args: megarl.verify.parse_args); the exit code."""
    import sys

    from megarl.hf_reference import hf_vl_logprobs
    from megarl.launch_local import RankFailure, run_ranks
    from megarl.numerics import fp32_bound
    from megarl.verify import compare, mean_abs_diff, report

    unsupported = [(flag, value) for flag, value, default in (
        ("--engine", args.engine, "megatron"), ("--lora", args.lora, None), ("--ep", args.ep, 1),
        ("--cp", args.cp, 1), ("--dtype", args.dtype, "float32"), ("--micro-batch", args.micro_batch, 1))
        if value != default]
    if unsupported or "WORLD_SIZE" in os.environ:
        what = ", ".join(f"{f} {v}" for f, v in unsupported) or "torchrun"
        print(f"error: {args.hf}: {spec.architecture} is verified in float32 against HF transformers at any --tp / --pp, "
              f"started as a plain command; not yet with {what}", file=sys.stderr)
        return 2
    try:
        batch = make_vl_batch(args.hf, spec, args.batch, args.seq_len, args.seed)
    except BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens = batch["tokens"]
    kwargs = dict(hf_dir=str(args.hf), batch=batch, tp=args.tp, pp=args.pp, seed=args.seed,
                  first_stage=args.first_stage_layers, last_stage=args.last_stage_layers)
    try:
        results = run_ranks("megarl.verify_vl:_rank_body", args.tp * args.pp, kwargs, timeout=args.timeout)
    except RankFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    got = next(r["megatron"] for r in results if r["megatron"] is not None)
    hf, stats = hf_vl_logprobs(args.hf, tokens, batch["pixel_values"], batch["image_grid_thw"],
                               spec.vision.image_token_id)
    lengths = torch.full((tokens.shape[0],), tokens.shape[1])
    longest_frame = int(batch["image_grid_thw"][:, 1:].prod(-1).max())
    m = spec.vision.spatial_merge_size
    tol = fp32_bound(spec, tokens.shape[1], hf.numel(), stats.rms, vision_segment=longest_frame)
    max_diff, rows = compare(hf, got, lengths)
    grids = [[t, h // m, w // m] for t, h, w in batch["image_grid_thw"].tolist()]
    source = f"the tokenizer and {tokens.shape[0]} synthetic images (merged grids {grids})"
    return report(args, rows, max_diff, source, mean_diff=mean_abs_diff(hf, got, lengths), scale=stats.scale,
                  fp32_tol=tol)
