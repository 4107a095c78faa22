"""A tiny random Qwen2.5-VL or Qwen3-VL, synthetic images and its processor inputs, for tests (no model hub needed).

    hf_dir = make_tiny_vl_model(tmp_path / "qwen2_5_vl")      # config.json, sharded safetensors, tokenizer, processor
    hf_dir = make_tiny_vl_model(tmp_path / "qwen3_vl", architecture="qwen3_vl")   # 16-pixel patches, DeepStack
    batch = vl_batch(hf_dir, [synthetic_image(100, 60, 0), synthetic_image(70, 90, 1)])
    # batch: input_ids [B, S], pixel_values [patches, 1176], image_grid_thw [images, 3], mm_token_type_ids [B, S]

The tokenizer is tests/helpers/tiny_models.py's byte-level BPE with Qwen2.5-VL's four vision special tokens added; the
image processor is transformers' own Qwen2-VL one (resize to multiples of 2 patches, normalise, cut patch x patch x
2-frame patches in merge-block order; 14-pixel patches for Qwen2.5-VL, 16 for Qwen3-VL), constructed locally with pixel
limits small enough for a handful of merged tokens.
Every row holds text, one image's placeholder span (<|vision_start|> <|image_pad|> x n <|vision_end|>) and text, with
no padding: every row has the same length.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

from megarl.verify_vl import synthetic_image  # the images `megarl verify` draws
from tests.helpers.tiny_models import VOCAB, make_tokenizer

__all__ = ["make_vl_tokenizer", "vision_token_ids", "image_processor", "randomize_vl_", "make_tiny_vl_model",
           "synthetic_image", "vl_batch", "hf_vl_logits", "hf_row_logits", "logprobs_of"]
# pixel limits in merged tokens (2 x 2 patches each): at most 24, at least 4
MIN_TOKENS, MAX_TOKENS = 4, 24
# the tiny Qwen3-VL's language model: four layers, so that PP2 keeps both DeepStack layers on the first stage
QWEN3_VL_LAYERS = 4


def make_vl_tokenizer(out_dir: Union[str, Path, None] = None):
    """make_tokenizer with the vision special tokens (megarl.bridge.tiny.TINY_VL_SPECIAL_TOKENS) added."""
    from megarl.bridge.tiny import TINY_VL_SPECIAL_TOKENS

    tok = make_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(TINY_VL_SPECIAL_TOKENS)})
    if out_dir is not None:
        tok.save_pretrained(str(out_dir))
    return tok


def vision_token_ids(tok) -> dict:
    from megarl.bridge.tiny import TINY_VL_SPECIAL_TOKENS

    names = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")
    return {n: tok.convert_tokens_to_ids(t) for n, t in zip(names, TINY_VL_SPECIAL_TOKENS)}


def image_processor(patch_size: int = 14):
    """transformers' Qwen2-VL image processor (the PIL backend: no torchvision here) at the tiny model's limits."""
    from transformers import Qwen2VLImageProcessorPil

    cell = (2 * patch_size) ** 2
    return Qwen2VLImageProcessorPil(min_pixels=MIN_TOKENS * cell, max_pixels=MAX_TOKENS * cell, patch_size=patch_size,
                                    temporal_patch_size=2, merge_size=2)


def _patch_size(hf_dir) -> int:
    import json

    return json.loads((Path(hf_dir) / "config.json").read_text())["vision_config"]["patch_size"]


def randomize_vl_(model, init_std: float = 0.1, seed: int = 0) -> None:
    """Every parameter re-drawn: matrices (and the patch convolution) N(0, init_std), norm weights 1 + N(0, 0.1),
    biases N(0, 0.1), so that a swapped or mis-sliced tensor changes the logprobs."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * init_std)
            elif ("norm" in name or "ln_q" in name) and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def make_tiny_vl_model(out_dir: Union[str, Path], *, seed: int = 0, init_std: float = 0.1,
                       max_shard_size: Optional[str] = "200KB", architecture: str = "qwen2_5_vl",
                       **config_overrides) -> Path:
    """A random tiny Qwen2_5_VLForConditionalGeneration or Qwen3VLForConditionalGeneration (architecture;
    megarl.bridge.tiny.tiny_vl_config with VOCAB tokens) saved to out_dir with its tokenizer and image processor.
    Returns the directory."""
    import torch
    import transformers

    from megarl.bridge.tiny import TINY_VL_ARCHS, tiny_vl_config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = make_vl_tokenizer(out)
    if architecture == "qwen3_vl":
        config_overrides.setdefault("num_hidden_layers", QWEN3_VL_LAYERS)
    config = tiny_vl_config(VOCAB, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                            architecture=architecture, **vision_token_ids(tok), **config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, TINY_VL_ARCHS[architecture][1])(config).to(torch.float32)
    randomize_vl_(model, init_std, seed)
    kwargs = {"safe_serialization": True}
    if max_shard_size:
        kwargs["max_shard_size"] = max_shard_size
    model.save_pretrained(str(out), **kwargs)
    image_processor(config.vision_config.patch_size).save_pretrained(str(out))
    return out


def vl_batch(hf_dir: Union[str, Path], images: list, seq_len: int = 40, seed: int = 0) -> dict:
    """One row per image: random text tokens, the image's placeholder span, random text tokens; seq_len tokens a row.

    Returns {"input_ids" [B, S], "pixel_values" [patches, patch_dim], "image_grid_thw" [B, 3] (long),
    "mm_token_type_ids" [B, S] (1 at image placeholders), "image_start" [B] (the first placeholder's column)}."""
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(hf_dir))
    ids = vision_token_ids(tok)
    specials = set(ids.values())
    processed = image_processor(_patch_size(hf_dir))(images=images, return_tensors="pt")
    grid = processed["image_grid_thw"].long()
    g = torch.Generator().manual_seed(seed)
    text_ids = torch.tensor([i for i in range(1, len(tok)) if i not in specials and i < VOCAB])
    rows, starts, types = [], [], []
    for thw in grid.tolist():
        n = thw[0] * thw[1] * thw[2] // 4
        free = seq_len - n - 2
        if free < 2:
            raise ValueError(f"seq_len={seq_len} leaves no text around an image of {n} tokens")
        before = int(torch.randint(1, free, (1,), generator=g))
        text = text_ids[torch.randint(0, len(text_ids), (free,), generator=g)]
        row = torch.cat([text[:before], torch.tensor([ids["vision_start_token_id"]]),
                         torch.full((n,), ids["image_token_id"]), torch.tensor([ids["vision_end_token_id"]]),
                         text[before:]])
        rows.append(row)
        starts.append(before + 1)
        types.append((row == ids["image_token_id"]).int())
    return {"input_ids": torch.stack(rows), "pixel_values": processed["pixel_values"].float(), "image_grid_thw": grid,
            "mm_token_type_ids": torch.stack(types), "image_start": torch.tensor(starts)}


def hf_vl_logits(hf_dir: Union[str, Path], batch: dict, images: bool = True, model=None):
    """HF transformers' logits [B, S, V] (float32, eager attention) of the batch: with the images (pixel_values), or
    without (images=False: the placeholder tokens keep their token embeddings) but with the same M-RoPE positions
    (transformers computes them itself from input_ids, mm_token_type_ids and image_grid_thw)."""
    import torch
    from transformers import AutoModelForImageTextToText

    if model is None:
        model = AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32,
                                                            attn_implementation="eager")
    model.eval()
    kwargs = dict(input_ids=batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                  mm_token_type_ids=batch["mm_token_type_ids"])
    if images:
        kwargs["pixel_values"] = batch["pixel_values"]
    with torch.no_grad():
        return model(**kwargs).logits.float()


def logprobs_of(logits, tokens):
    """Per-token logprobs [B, S-1] of logits [B, S, V]."""
    import torch

    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def hf_row_logits(model, ids, prompt_len: int, pixel_values=None, image_grid_thw=None):
    """transformers' logits [n, V] (float32) of one row ids [1, n] whose first prompt_len tokens are the prompt
    (its image placeholders filled with pixel_values' image features; image tokens after the prompt, sampled by a
    policy, stay text tokens, as an engine decoding them feeds them), M-RoPE positions by the model's get_rope_index
    with the prompt's placeholders only."""
    import torch

    image_id = model.config.image_token_id
    types = torch.zeros_like(ids, dtype=torch.int)
    types[:, :prompt_len] = (ids[:, :prompt_len] == image_id).int()
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
        if pixel_values is not None:
            features = torch.cat(model.model.get_image_features(pixel_values, image_grid_thw,
                                                                return_dict=True).pooler_output)
            embeds[types.bool()] = features.to(embeds.dtype)
        positions, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=types,
                                                  image_grid_thw=image_grid_thw)
        return model(inputs_embeds=embeds, position_ids=positions).logits[0].float()


def tower_from_checkpoint(tower_cls, hf_dir, spec):
    """megarl's vision tower of `spec` (a tower class of megarl.megatron.vlm) with every parameter loaded from the HF
    checkpoint in hf_dir through the bridge mapping's vision entries (each parameter exactly once)."""
    from megarl.bridge.mapping import VISION_PREFIX, Mapping
    from tests.helpers.tiny_models import read_checkpoint

    tower = tower_cls(spec.vision)
    ckpt = read_checkpoint(hf_dir)
    params = dict(tower.named_parameters())
    loaded = 0
    for entry in Mapping(spec).entries:
        if entry.megatron.startswith(VISION_PREFIX):
            params[entry.megatron[len(VISION_PREFIX):]].data.copy_(ckpt[entry.hf[0]])
            loaded += 1
    assert loaded == len(params)
    return tower
