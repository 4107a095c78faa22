"""Image prompts for a vision-language model (Qwen2.5-VL, Qwen3-VL): the prompt's token ids with each image's
placeholder run, and the image processor's patches, as the model's own processor lays them out.

    prompts = ImagePrompts(model_dir, tokenizer)
    ids = prompts.prompt_ids(record)                   # <image> -> <|vision_start|> <|image_pad|> x n <|vision_end|>
    pixel_values, image_grid_thw = prompts.pixels(record.images)   # [patches, patch_dim] float32, [images, 3] long
    batch.update(prompts.batch_images(records, prompt_index))       # per sample, padded (megarl.batching)

n, an image's merged tokens, is t * h / merge * w / merge of its patch grid (the processor's resize of the image).
The chat template is applied to the messages as written, then each `<image>` of the text is replaced by the image's
run, in order, as Qwen's processor does with its `<|image_pad|>`. The trainer and the engine both call `pixels` on the
same image bytes: the same patches, so the engine's logprobs and the trainer's see the same image.
"""
from __future__ import annotations

import io
import json
import os
from typing import Any, Optional, Sequence

import torch

from megarl.data.dataset import DataError, PromptRecord
from megarl.data.images import PLACEHOLDER, ImageRef


def open_image(ref: ImageRef):
    """The image (PIL, RGB) of encoded bytes or a path."""
    from PIL import Image

    with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as im:
        return im.convert("RGB")


class ImagePrompts:
    """A vision-language model's tokenizer and image processor (preprocessor_config.json of model_dir), and its
    vision token ids (config.json)."""

    def __init__(self, model_dir: str, tokenizer: Any):
        from transformers import AutoImageProcessor

        with open(os.path.join(model_dir, "config.json")) as f:
            config = json.load(f)
        if "vision_config" not in config:
            raise DataError(f"the data has images but the model at {model_dir} reads text only (no vision_config in "
                            "its config.json); use a vision-language model or drop the images column")
        try:
            self.processor = AutoImageProcessor.from_pretrained(model_dir)
        except (OSError, ValueError) as exc:
            raise DataError(f"{model_dir}: image prompts need the model's image processor "
                            f"(preprocessor_config.json): {exc}") from None
        self.tokenizer = tokenizer
        self.merge = int(config["vision_config"].get("spatial_merge_size", 2))
        self.image_token_id = int(config["image_token_id"])
        self.start_id = int(config["vision_start_token_id"])
        self.end_id = int(config["vision_end_token_id"])

    def pixels(self, refs: Sequence[ImageRef]) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values [patches, patch_dim] float32, image_grid_thw [images, 3] long) of the images, in order."""
        out = self.processor(images=[open_image(r) for r in refs], return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()

    def token_counts(self, grid: torch.Tensor) -> list[int]:
        """Merged tokens of each image of image_grid_thw [images, 3]."""
        return [t * h * w // self.merge ** 2 for t, h, w in grid.tolist()]

    def prompt_ids(self, record: PromptRecord, apply_chat_template: bool = True, tools: Optional[list] = None
                   ) -> list[int]:
        """The prompt's token ids with each `<image>` replaced by its image's placeholder run."""
        _, grid = self.pixels(record.images)
        if isinstance(record.prompt, str):
            text, special = record.prompt, True
        else:
            if not apply_chat_template:
                raise DataError(f"prompt {record.uid} is a list of chat messages but data.apply_chat_template=false; "
                                "set data.apply_chat_template=true or store the prompt as plain text")
            text = self.tokenizer.apply_chat_template(list(record.prompt), add_generation_prompt=True, tokenize=False,
                                                      **({"tools": tools} if tools else {}))
            special = False
        pieces = text.split(PLACEHOLDER)
        counts = self.token_counts(grid)
        if len(pieces) - 1 != len(counts):  # the loader checked the row; a chat template may add or drop text
            raise DataError(f"prompt {record.uid}: {len(pieces) - 1} {PLACEHOLDER} placeholders after the chat "
                            f"template for {len(counts)} images")
        ids = self.tokenizer(pieces[0], add_special_tokens=special)["input_ids"]
        for piece, n in zip(pieces[1:], counts):
            ids += [self.start_id] + [self.image_token_id] * n + [self.end_id]
            ids += self.tokenizer(piece, add_special_tokens=False)["input_ids"]
        return ids

    def batch_images(self, records: Sequence[PromptRecord], prompt_index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The training batch's image tensors (megarl.batching.VISION_KEYS) of samples whose prompts are
        records[prompt_index[i]] (prompt_index [N]): pixel_values [N, P_max, patch_dim] float32 and image_grid_thw
        [N, I_max, 3] long, each row's images first and zeros after. {} when no sample has images."""
        per_prompt: dict = {}
        for p in sorted(set(prompt_index.tolist())):
            if records[p].images:
                per_prompt[p] = self.pixels(records[p].images)
        return padded_images([per_prompt.get(p) for p in prompt_index.tolist()])

    def rows_images(self, refs: Sequence[Sequence[ImageRef]]) -> dict[str, torch.Tensor]:
        """batch_images of rows given by their images (refs[i]: row i's, () for a text row)."""
        return padded_images([self.pixels(r) if r else None for r in refs])


def padded_images(rows: Sequence[Optional[tuple[torch.Tensor, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Each row's (pixel_values [P_i, patch_dim], image_grid_thw [I_i, 3]) or None (no images) as the batch's
    pixel_values [N, P_max, patch_dim] float32 and image_grid_thw [N, I_max, 3] long, each row's images first and zeros
    after. {} when no row has images."""
    present = [r for r in rows if r is not None]
    if not present:
        return {}
    n, dim = len(rows), present[0][0].shape[1]
    width = max(px.shape[0] for px, _ in present)
    count = max(g.shape[0] for _, g in present)
    pixel_values = torch.zeros(n, width, dim)
    grids = torch.zeros(n, count, 3, dtype=torch.long)
    for i, row in enumerate(rows):
        if row is not None:
            px, g = row
            pixel_values[i, :px.shape[0]] = px
            grids[i, :g.shape[0]] = g
    return {"pixel_values": pixel_values, "image_grid_thw": grids}
