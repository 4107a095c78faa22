"""What every engine samples with: the rollout config as vLLM's SamplingParams keywords (the transformers engine reads
the same keywords)."""
from __future__ import annotations

from typing import Any, Optional

from megarl.config.schema import RolloutConfig


def sampling_kwargs(cfg: RolloutConfig, validate: bool = False, n: Optional[int] = None,
                    greedy: bool = False) -> dict[str, Any]:
    """Keyword arguments of vllm.SamplingParams for a training (or, with validate=True, validation) rollout.

    Validation takes temperature, top_k, top_p, n and do_sample from rollout.val_kwargs; everything else (length,
    stop tokens, penalties, logprobs) is shared. do_sample=False means greedy: temperature 0, no top-k/top-p.
    greedy=True: one greedy response per prompt whatever the config says (ReMax's baseline)."""
    src = cfg.val_kwargs if validate else cfg
    if greedy:
        n = 1
    greedy = greedy or not src.do_sample or src.temperature == 0
    kw: dict[str, Any] = {
        "n": n if n is not None else src.n,
        "temperature": 0.0 if greedy else float(src.temperature),
        "top_p": 1.0 if greedy else float(src.top_p),
        "top_k": 0 if greedy or src.top_k in (-1, 0) else int(src.top_k),
        "repetition_penalty": float(cfg.repetition_penalty),
        "max_tokens": int(cfg.response_length),
        "ignore_eos": bool(cfg.ignore_eos),
        "stop": list(cfg.stop) or None,
        "stop_token_ids": list(cfg.stop_token_ids) or None,
        "logprobs": 0 if cfg.calculate_log_probs else None,  # 0: only the sampled token's logprob
        "detokenize": bool(cfg.stop),  # stop strings need text; otherwise skip detokenisation
    }
    return kw
