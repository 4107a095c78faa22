"""The transformers engine's decoding: a batched decode loop over a HF causal LM with its own KV cache, and the
sampler it runs at every step, written to compute what vLLM 0.32's v1 sampler computes for the SamplingParams megarl
sends (megarl.rollout.vllm.engine_args.sampling_kwargs), so that the two engines' rollouts mean the same:

    raw logits (float32) --[raw_logprobs]--> logprobs of the model at temperature 1
        -> repetition penalty (tokens of the prompt and of the output so far: positive logits / p, others * p)
        -> greedy rows: argmax; [processed_logprobs] log_softmax of the penalised logits (no temperature, as vLLM)
        -> sampled rows: / temperature -> top-k -> top-p (vLLM's sort-and-cumsum rule) -> [processed_logprobs]
           log_softmax of the masked logits; the token is argmax(probs / q), q ~ Exp(1) from the row's generator
           (vLLM's exponential race: a row with a seed draws from its own generator, so a batch is reproducible
           whatever else runs beside it)

Pure functions of tensors; the loop takes the model, the rows and a callable that says whether to abort.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

_EPS = 1e-5  # vLLM's _SAMPLING_EPS: a temperature below it is greedy


@dataclass
class Row:
    """One sequence to continue: its prompt, its SamplingParams keywords (sampling_kwargs' keys; n is ignored: one
    row is one sample) and its seed (None: the engine's generator)."""

    prompt: list
    sampling: Mapping[str, Any]
    seed: Optional[int] = None
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str = "abort"
    # a vision-language prompt's images: (pixel_values [patches, patch_dim], image_grid_thw [images, 3]), the prompt
    # holding each image's placeholder run
    images: Optional[tuple] = None


def penalize(logits: torch.Tensor, seen: torch.Tensor, penalty: torch.Tensor) -> torch.Tensor:
    """vLLM's repetition penalty. logits [B, V] float32; seen [B, V] bool (token in the prompt or the output so far);
    penalty [B] (1: none). Returns [B, V]."""
    p = penalty[:, None].expand_as(logits)
    scaled = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen & (p != 1.0), scaled, logits)


def top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """vLLM's apply_top_k_top_p: logits [B, V] (after temperature); top_k [B] long (0: off); top_p [B] (1: off).
    Masked entries are -inf. Returns [B, V]."""
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
    kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))  # the k-th largest value: keep everything >= it
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs_sum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = probs_sum <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False  # at least one token stays
    drop &= (top_p < 1.0).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def sample_step(logits: torch.Tensor, seen: torch.Tensor, params: dict, generators: Sequence[torch.Generator],
                mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """One sampler step. logits [B, V] (any float dtype); seen [B, V] bool; params: {"temperature", "top_k", "top_p",
    "repetition_penalty"} tensors [B]; generators: one per row; mode: rollout.logprobs_mode. Returns (tokens [B]
    long, logprobs of those tokens [B] float32)."""
    logits = logits.float()
    raw = logits.log_softmax(dim=-1) if mode == "raw_logprobs" else None
    logits = penalize(logits, seen, params["repetition_penalty"])
    greedy = params["temperature"] < _EPS
    tokens = logits.argmax(dim=-1)
    processed = logits.log_softmax(dim=-1) if mode != "raw_logprobs" and bool(greedy.any()) else None
    if not bool(greedy.all()):
        temp = torch.where(greedy, torch.ones_like(params["temperature"]), params["temperature"])
        masked = top_k_top_p(logits / temp[:, None], params["top_k"], params["top_p"])
        probs = masked.softmax(dim=-1)
        q = torch.empty_like(probs)
        for i, g in enumerate(generators):
            q[i].exponential_(generator=g)
        sampled = probs.div(q).argmax(dim=-1)
        tokens = torch.where(greedy, tokens, sampled)
        if mode != "raw_logprobs":
            lp = masked.log_softmax(dim=-1)
            processed = lp if processed is None else torch.where(greedy[:, None], processed, lp)
    chosen = raw if raw is not None else processed
    return tokens, chosen.gather(1, tokens[:, None]).squeeze(1)


def row_params(rows: Sequence[Row]) -> dict:
    """The per-row sampler settings as tensors [B]."""
    def col(key, default, dtype):
        return torch.tensor([r.sampling.get(key, default) if r.sampling.get(key) is not None else default
                             for r in rows], dtype=dtype)
    return {"temperature": col("temperature", 1.0, torch.float32), "top_k": col("top_k", 0, torch.long),
            "top_p": col("top_p", 1.0, torch.float32),
            "repetition_penalty": col("repetition_penalty", 1.0, torch.float32)}


def _left_pad(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, P] ids, [B, P] attention mask), prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


def decode(model: torch.nn.Module, rows: Sequence[Row], eos_ids: Sequence[int], pad_id: int,
           default_generator: torch.Generator, mode: str, aborted: Callable[[], bool],
           stop_text: Optional[Callable[[Sequence[int], Sequence[str]], bool]] = None) -> None:
    """Continue every row in one batch (fills tokens, logprobs, finish_reason in place). Rows end at an EOS token
    (unless ignore_eos), a token of stop_token_ids or a stop string ("stop"; the token stays in the output, as vLLM),
    or at max_tokens ("length"); `aborted()` true before a step ends the unfinished rows ("abort"). Finished rows leave
    the batch (and its KV cache) at once. stop_text(tokens, stops): whether decoded tokens contain a stop string."""
    from transformers import DynamicCache

    if not rows:
        return
    device = next(model.parameters()).device
    vocab = model.get_output_embeddings().weight.shape[0]
    ids, mask = _left_pad([r.prompt for r in rows], pad_id)
    ids, mask = ids.to(device), mask.to(device)
    params = {k: v.to(device) for k, v in row_params(rows).items()}
    generators = [torch.Generator(device=device).manual_seed(int(r.seed)) if r.seed is not None
                  else default_generator for r in rows]
    seen = torch.zeros((len(rows), vocab), dtype=torch.bool, device=device)
    seen.scatter_(1, ids.clamp(max=vocab - 1), mask.bool())
    budget = [int(r.sampling.get("max_tokens") or 1) for r in rows]
    stops = [set(r.sampling.get("stop_token_ids") or ()) | (set() if r.sampling.get("ignore_eos") else set(eos_ids))
             for r in rows]
    live = list(range(len(rows)))  # rows still in the batch, in batch order
    cache = DynamicCache()
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    images: dict = {}
    if is_vision_language(model):
        positions, images = vision_inputs(model, rows, ids, mask)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache,
                    use_cache=True, logits_to_keep=1, **images)
        # the next token's position: one past the row's largest (an image advances M-RoPE by its larger side only)
        step_pos = positions.reshape(-1, *positions.shape[-2:]).amax(dim=(0, 2)).unsqueeze(1) + 1
        while True:
            if aborted():
                break
            tokens, lps = sample_step(out.logits[:, -1, :], seen, params, [generators[i] for i in live], mode)
            keep = []
            for j, i in enumerate(live):
                row, tok = rows[i], int(tokens[j])
                row.tokens.append(tok)
                row.logprobs.append(float(lps[j]))
                if tok in stops[i] or (stop_text is not None and row.sampling.get("stop")
                                       and stop_text(row.tokens, row.sampling["stop"])):
                    row.finish_reason = "stop"
                elif len(row.tokens) >= budget[i]:
                    row.finish_reason = "length"
                else:
                    keep.append(j)
            seen[torch.arange(len(live), device=device), tokens] = True
            if not keep:
                return
            if len(keep) < len(live):  # finished rows leave the batch and the cache
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                tokens, mask, seen, step_pos = tokens[index], mask[index], seen[index], step_pos[index]
                params = {k: v[index] for k, v in params.items()}
                live = [live[j] for j in keep]
            mask = torch.cat([mask, torch.ones((len(live), 1), dtype=mask.dtype, device=device)], dim=1)
            out = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=step_pos,
                        past_key_values=cache, use_cache=True)
            step_pos = step_pos + 1
    for i in live:
        rows[i].finish_reason = "abort"


def is_vision_language(model: torch.nn.Module) -> bool:
    """Whether `model` is a transformers vision-language model with M-RoPE positions (Qwen2.5-VL, Qwen3-VL)."""
    return hasattr(getattr(model, "model", None), "get_rope_index")


def vision_inputs(model: torch.nn.Module, rows: Sequence[Row], ids: torch.Tensor, mask: torch.Tensor) -> tuple:
    """(M-RoPE positions [3, B, P] of the left-padded prompts ids / mask [B, P], the prefill's image keywords) of a
    vision-language model: the rows' images in row order, positions by the model's own get_rope_index (text counts up
    on all three axes; an image's tokens by frame, row and column)."""
    image_id = model.config.image_token_id
    mm_types = (ids == image_id).int()
    pictured = [r.images for r in rows if r.images is not None]
    grid = torch.cat([g for _, g in pictured]).to(ids.device) if pictured else None
    positions, _ = model.model.get_rope_index(input_ids=ids, mm_token_type_ids=mm_types, image_grid_thw=grid,
                                              attention_mask=mask)
    if not pictured:
        return positions, {}
    pixels = torch.cat([p for p, _ in pictured]).to(ids.device, next(model.parameters()).dtype)
    return positions, {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": mm_types}


def sequence_logprobs(model: torch.nn.Module, token_ids: Sequence[Sequence[int]], pad_id: int) -> list[list[float]]:
    """Each sequence's logprob of every token after the first given its prefix, at temperature 1 (L - 1 values for
    L tokens), in one right-padded forward."""
    device = next(model.parameters()).device
    width = max(len(t) for t in token_ids)
    ids = torch.full((len(token_ids), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, t in enumerate(token_ids):
        ids[i, :len(t)] = torch.tensor(list(t))
        mask[i, :len(t)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.float()
    lp = logits[:, :-1].log_softmax(dim=-1).gather(2, ids[:, 1:, None].to(device)).squeeze(2).cpu()
    return [lp[i, :len(t) - 1].tolist() for i, t in enumerate(token_ids)]
