"""`megarl merge --verify`: transformers on the merged directory against the megatron model loaded from the checkpoint
(one process, TP1), both computing in float32 from the same weights, judged by the model's float32 bound.

The transformers side and the bound are the ones `megarl verify` uses (megarl.hf_reference, megarl.numerics); what is
particular to a merge is the megatron side: the model comes from the checkpoint's dist_checkpointing files, not from
an HF directory, with the LoRA adapters applied for a LoRA actor.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from megarl.bridge.hf_config import load_spec
from megarl.checkpoint.dcp_reader import DistCheckpoint
from megarl.checkpoint.merge import LORA_MARK, MergeError, MergeReport, lora_settings


def megatron_outputs_rank(model_dir: str, hf_dir: str, tokens, critic: bool):
    """On one rank: a TP1 megatron model loaded from the dist checkpoint; its logprobs (or values) of `tokens`."""
    from megatron.core import dist_checkpointing

    from megarl.megatron.forward import token_logprobs, token_values
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.parallel import Layout, init_model_parallel

    spec = load_spec(hf_dir)
    if spec.score_head and not critic:
        raise MergeError("verify: an actor merged as a value model")
    init_model_parallel(Layout(), seed=0)
    ckpt = DistCheckpoint(model_dir)
    rows = ckpt.shape("embedding.word_embeddings.weight")[0]
    model = build_gpt_model(spec, value_head=critic, dtype=torch.float32, vocab_pad_multiple=rows)
    if any(LORA_MARK in k for k in ckpt.tensors):  # a LoRA actor: the merged weights are compared with base + adapters
        from megarl.lora.layers import apply_lora

        apply_lora(model, spec, lora_settings(Path(model_dir).parent))
    state = dist_checkpointing.load(model.sharded_state_dict(), model_dir, strict="assume_ok_unexpected")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise MergeError(f"verify: the megatron model did not load {missing[:8]} from {model_dir}")
    model.eval()
    n = tokens.shape[0]
    return token_values(model, tokens, micro_batch_size=n) if critic else token_logprobs(model, tokens,
                                                                                       micro_batch_size=n)


def verify_merge(report: MergeReport, tol: Optional[float] = None, n: int = 2, seq: int = 32, seed: int = 0) -> float:
    """Compare transformers on the merged directory with the checkpoint's megatron model, both computing in float32
    from the same weights. Returns the max abs difference of logprobs (values for the critic); raises MergeError above
    `tol`: by default the float32 bound derived from the model (megarl.numerics.fp32_bound), 2e-2 when --dtype rounded
    the weights to another dtype than the checkpoint's."""
    from megarl.hf_reference import hf_logprobs, hf_values
    from megarl.launch_local import run_ranks
    from megarl.numerics import fp32_bound

    critic = report.model == "critic"
    spec = load_spec(report.out)
    if spec.vision is not None:  # megatron's text path has no M-RoPE positions for images: it would compare nothing
        raise MergeError(f"verify: {report.out} is a vision-language model, whose logprobs need images and M-RoPE "
                         f"positions: the merge is written; compare it with transformers by `megarl verify --hf "
                         f"{report.out} --tp 1` (synthetic images through the checkpoint's image processor)")
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, spec.vocab_size, (n, seq), generator=g)
    ref = run_ranks("megarl.checkpoint.merge_verify:megatron_outputs_rank", 1,
                    {"model_dir": str(report.step_dir / report.model), "hf_dir": str(report.out), "tokens": tokens,
                     "critic": critic}, timeout=None)[0]
    if critic:
        got = hf_values(report.out, tokens)
        rms = float(got.pow(2).mean().sqrt())
    else:  # every position is a real token: the logits' RMS over all of them
        got, stats = hf_logprobs(report.out, tokens, torch.full((n,), seq))
        rms = stats.rms
    diff = (got - ref).abs().max().item()
    if tol is None and report.dtype != report.checkpoint_dtype:
        tol = 2e-2
    elif tol is None:
        tol = fp32_bound(spec, seq, got.numel(), rms, score=critic)
    if not diff < tol:
        raise MergeError(f"verify: max |{'value' if critic else 'logprob'} diff| between transformers on {report.out} "
                         f"and the megatron model of {report.step_dir / report.model} is {diff:.3e} >= {tol}")
    return diff
