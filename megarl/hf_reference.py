"""The reference side of every parity check: HF transformers' outputs on a Hugging Face model directory, computed in
float32 with eager attention on the CPU, and the statistics of its logits that the float32 bound
(megarl.numerics.fp32_bound) and verify's bf16 tolerance scale with.

`megarl verify` compares megarl's megatron model with these; `megarl merge --verify` compares the checkpoint's megatron
model with them on the merged directory. No megatron and no process group here: both stand on it.
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, Optional

import torch


class LogitStats(NamedTuple):
    scale: float  # RMS of the logits' std over the vocabulary: what bf16 rounding of the logits moves logprobs by
    rms: float  # RMS of the logits: what float32 rounding of the sums that make them scales with


def real_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """[B, width] True at the logprob positions of real tokens (position t scores token t+1 < length)."""
    return torch.arange(width)[None, :] < (lengths[:, None] - 1)


def logits_scale(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """RMS over the real positions (mask [B, S-1]) of the logits' standard deviation over the vocabulary."""
    return float(logits.float().std(dim=-1)[mask].pow(2).mean().sqrt())


def logits_rms(logits: torch.Tensor, mask: torch.Tensor) -> float:
    """RMS of the logits over the real positions (mask [B, S-1]) and the vocabulary (what their rounding scales
    with)."""
    return float(logits.float()[mask].pow(2).mean().sqrt())


def _load(hf_dir: str | Path, value_model: bool):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    cls = AutoModelForSequenceClassification if value_model else AutoModelForCausalLM
    return cls.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")


def hf_logprobs(hf_dir: str | Path, tokens: torch.Tensor, lengths: Optional[torch.Tensor] = None,
                lora: Optional[str] = None):
    """HF transformers logprobs [B, S-1], float32, eager attention, on the CPU; with `lengths` also the logits'
    statistics over the real positions, LogitStats(scale (logits_scale), rms (logits_rms)); with `lora`, of the base
    with that PEFT adapter loaded by peft.PeftModel.from_pretrained."""
    model = _load(hf_dir, value_model=False)
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()[:, :-1]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    if lengths is None:
        return lp
    mask = real_mask(lengths, lp.shape[1])
    return lp, LogitStats(logits_scale(logits, mask), logits_rms(logits, mask))


def hf_scores(hf_dir: str | Path, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """HF AutoModelForSequenceClassification scores [B] (float32, eager attention), each sequence alone."""
    model = _load(hf_dir, value_model=True)
    model.eval()
    with torch.no_grad():
        return torch.stack([model(input_ids=tokens[i:i + 1, :n]).logits.float()[0, 0]
                            for i, n in enumerate(lengths.tolist())])


def hf_values(hf_dir: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """Per-token values [B, S] of a value model (*ForSequenceClassification, num_labels 1): its score head on every
    position's last hidden state, as a megarl critic reads it."""
    model = _load(hf_dir, value_model=True)
    model.eval()
    with torch.no_grad():
        hidden = model.model(input_ids=tokens).last_hidden_state
        return model.score(hidden).squeeze(-1).float()


def hf_vl_logprobs(hf_dir: str | Path, tokens: torch.Tensor, pixel_values: torch.Tensor,
                   image_grid_thw: torch.Tensor, image_token_id: int):
    """HF transformers' logprobs [B, S-1] and LogitStats of a vision-language model (AutoModelForImageTextToText,
    float32, eager attention) on unpadded rows tokens [B, S] holding the image placeholders of pixel_values
    [patches, patch_dim] / image_grid_thw [images, 3]; transformers computes its M-RoPE positions itself."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(str(hf_dir), dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens, pixel_values=pixel_values, image_grid_thw=image_grid_thw,
                       mm_token_type_ids=(tokens == image_token_id).int()).logits.float()[:, :-1]
    lp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
    mask = torch.ones(lp.shape, dtype=torch.bool)
    return lp, LogitStats(logits_scale(logits, mask), logits_rms(logits, mask))
