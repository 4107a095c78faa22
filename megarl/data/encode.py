"""Prompt tokenisation and the prompt_length policy (data.truncation).

Chat prompts go through the tokenizer's chat template with a generation prompt appended, so the model's first
generated token is the start of the assistant turn. Plain-text prompts are encoded as they are, with the
tokenizer's special tokens (e.g. BOS): a plain string is taken to be already formatted, so no template is applied.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, Optional, Sequence

from megarl.data.dataset import DataError, PromptRecord

Truncation = Literal["error", "filter", "left", "right"]


def _as_id_list(out: Any, uid: str) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True) by default (return_dict=True);
    # 4.x returned a plain list. Accept both, and a batch of one.
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if isinstance(out, list) and out and isinstance(out[0], list):
        if len(out) != 1:
            raise DataError(f"prompt {uid}: the tokenizer returned {len(out)} sequences for one prompt")
        out = out[0]
    if not isinstance(out, list) or not all(isinstance(t, int) for t in out):
        raise DataError(f"prompt {uid}: the tokenizer returned {type(out).__name__}, expected a list of token ids")
    return out


def _check_chat(record: PromptRecord, tokenizer: Any, apply_chat_template: bool) -> None:
    if not apply_chat_template:
        raise DataError(f"prompt {record.uid} is a list of chat messages but data.apply_chat_template=false; set "
                        f"data.apply_chat_template=true or store the prompt as plain text")
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"prompt {record.uid} is a list of chat messages but the tokenizer has no chat_template; "
                        f"use a tokenizer with one (tokenizer_config.json / chat_template.jinja) or plain-text prompts")


def encode_one(record: PromptRecord, tokenizer: Any, apply_chat_template: bool = True) -> list[int]:
    """Token ids of one prompt (no length policy)."""
    if isinstance(record.prompt, str):
        return _as_id_list(tokenizer(record.prompt, add_special_tokens=True), record.uid)
    _check_chat(record, tokenizer, apply_chat_template)
    out = tokenizer.apply_chat_template(list(record.prompt), add_generation_prompt=True, tokenize=True)
    return _as_id_list(out, record.uid)


def encode_many(records: Sequence[PromptRecord], tokenizer: Any, apply_chat_template: bool = True,
                tools: Optional[list] = None, images: Any = None) -> list[list[int]]:
    """encode_one of every record, with one tokenizer call for the chat prompts and one for the plain-text ones:
    batched calls cost a fraction of one call per prompt (a dataset's start-up time), and give the same ids.
    tools: OpenAI function schemas handed to the chat template (multi-turn rollouts: Qwen2.5's template lists them
    in the system prompt). images: a megarl.data.vision.ImagePrompts that encodes the prompts with images (their
    placeholder runs expanded); without one such a prompt is a DataError."""
    encoded: list = [None] * len(records)
    pictured = [i for i, r in enumerate(records) if r.images]
    if pictured and images is None:
        raise DataError(f"prompt {records[pictured[0]].uid} has images but no image processor was given")
    for i in pictured:
        encoded[i] = images.prompt_ids(records[i], apply_chat_template, tools)
    chat = [i for i, r in enumerate(records) if not isinstance(r.prompt, str) and not r.images]
    text = [i for i, r in enumerate(records) if isinstance(r.prompt, str) and not r.images]
    if chat:
        _check_chat(records[chat[0]], tokenizer, apply_chat_template)
        out = tokenizer.apply_chat_template([list(records[i].prompt) for i in chat], add_generation_prompt=True,
                                            tokenize=True, **({"tools": tools} if tools else {}))
        for i, ids in zip(chat, out["input_ids"] if hasattr(out, "keys") else out):
            encoded[i] = _as_id_list(ids, records[i].uid)
    if text:
        out = tokenizer([records[i].prompt for i in text], add_special_tokens=True)
        for i, ids in zip(text, out["input_ids"]):
            encoded[i] = _as_id_list(ids, records[i].uid)
    return encoded


def encode_prompts(records: Sequence[PromptRecord], tokenizer: Any, prompt_length: int,
                   truncation: Truncation = "error", apply_chat_template: bool = True, tools: Optional[list] = None,
                   images: Any = None) -> tuple[list[PromptRecord], list[list[int]], dict[str, int]]:
    """Tokenise prompts and apply the rollout.prompt_length policy.

    truncation: "error" raises on the first over-long prompt (naming its uid and length, and how many are over);
    "filter" drops over-long prompts; "left" keeps the last prompt_length tokens (the end of the prompt, where the
    question usually is); "right" keeps the first prompt_length tokens.
    Returns (kept records with prompt_ids set, their id lists, report) with report keys num_prompts (input count),
    num_filtered, num_truncated, num_kept, max_prompt_tokens (longest before the policy).
    """
    if prompt_length < 1:
        raise ValueError(f"prompt_length must be >= 1, got {prompt_length}")
    if truncation not in ("error", "filter", "left", "right"):
        raise ValueError(f"data.truncation must be one of error, filter, left, right; got {truncation!r}")
    encoded = encode_many(records, tokenizer, apply_chat_template, tools, images)
    too_long = [i for i, ids in enumerate(encoded) if len(ids) > prompt_length]
    cut_images = [i for i in too_long if records[i].images]
    if cut_images and truncation in ("left", "right"):  # a cut placeholder run no longer matches its image
        first = cut_images[0]
        raise DataError(f"prompt {records[first].uid} (index {records[first].index}) has {len(encoded[first])} tokens "
                        f"with its images' placeholders, over rollout.prompt_length={prompt_length}, and "
                        f"data.truncation={truncation} would cut an image's tokens; raise rollout.prompt_length or "
                        "set data.truncation to filter")
    if too_long and truncation == "error":
        first = too_long[0]
        raise DataError(f"prompt {records[first].uid} (index {records[first].index}) has {len(encoded[first])} tokens, "
                        f"over rollout.prompt_length={prompt_length} ({len(too_long)} of {len(records)} prompts are "
                        f"over); raise rollout.prompt_length or set data.truncation to filter, left or right")
    kept_records, kept_ids = [], []
    over = set(too_long)
    for i, (record, ids) in enumerate(zip(records, encoded)):
        if i in over:
            if truncation == "filter":
                continue
            ids = ids[-prompt_length:] if truncation == "left" else ids[:prompt_length]
        kept_records.append(dataclasses.replace(record, prompt_ids=tuple(ids)))
        kept_ids.append(ids)
    report = {
        "num_prompts": len(records),
        "num_filtered": len(too_long) if truncation == "filter" else 0,
        "num_truncated": len(too_long) if truncation in ("left", "right") else 0,
        "num_kept": len(kept_records),
        "max_prompt_tokens": max((len(ids) for ids in encoded), default=0),
    }
    if not kept_records:
        raise DataError(f"all {len(records)} prompts are longer than rollout.prompt_length={prompt_length} and were "
                        f"filtered; raise rollout.prompt_length or set data.truncation=left")
    return kept_records, kept_ids, report


def format_report(report: dict[str, int], split: str = "train") -> str:
    """One log line for the encode report, e.g. 'train prompts: 1000, kept 990 (10 over prompt_length filtered)'."""
    line = f"{split} prompts: {report['num_prompts']}, kept {report['num_kept']}"
    if report["num_filtered"]:
        line += f" ({report['num_filtered']} over prompt_length filtered)"
    if report["num_truncated"]:
        line += f" ({report['num_truncated']} over prompt_length truncated)"
    return line + f", longest {report['max_prompt_tokens']} tokens"
