"""Compute per real token of packed micro-batches vs padded ones, on a batch with a long-tail length distribution.

    python bench/bench_packing.py                      # 64 rows, lognormal lengths, median 48, longest 16x (768)
    python bench/bench_packing.py --rows 128 --median 128 --micro-batch 8 --hidden 512 --layers 4 --repeat 5

The batch's lengths are lognormal, scaled so that the longest row is exactly 16x the median. It is cut into
micro-batches two ways: fixed-size (--micro-batch rows, in a random order) and token budgets (--budget real tokens,
first-fit decreasing: megarl.batching.token_budget_groups). For each, computed tokens / real tokens:
  padded: rows x longest row of each micro-batch (the layout before packing: each micro-batch cut to its own
          longest row, every row padded to it);
  packed: the pack's length (megarl.megatron.packing: the rows end to end, padded at the end to a multiple of
          --multiple, the TP size under sequence parallelism).
Then the log-prob pass over the whole batch, packed and padded alternately, best of --repeat each:
  packed: megarl.megatron.forward.token_logprobs / forward_by_token_budget, the product path (megatron's schedule,
          packed micro-batches, megarl's SDPA attention per row);
  padded: the same model on each micro-batch as [rows, longest] with a causal mask, logprobs from the padded
          logits: the forward before packing, kept here only as the baseline (an equivalent computation: the same
          layers, kernels and logprob function on the padded micro-batch).
The two passes' logprobs are compared on the real tokens (they agree to rounding). One process, TP1, float32,
--threads torch threads.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

PACKED_TARGET = 1.02  # computed / real tokens of packed micro-batches


def long_tail_lengths(rows: int, median: int, tail: float, seed: int) -> torch.Tensor:
    """[rows] lognormal lengths with median `median` and the longest exactly `tail` x the median (at least 2)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rows, generator=g, dtype=torch.float64)
    z = z - z.median()
    sigma = math.log(tail) / float(z.max())
    lengths = (median * torch.exp(sigma * z)).round().long().clamp(min=2)
    lengths[int(z.argmax())] = int(round(tail * median))
    return lengths


def token_ratios(groups: list, lengths: torch.Tensor, multiple: int) -> tuple[float, float]:
    """(padded, packed) computed / real tokens of micro-batches `groups` (row indices) of rows with `lengths`."""
    from megarl.megatron.packing import pack_size

    real = int(lengths.sum())
    padded = sum(len(g) * int(lengths[g].max()) for g in groups)
    packed = sum(pack_size(lengths[g].tolist(), multiple) for g in groups)
    return padded / real, packed / real


def padded_logprobs(model, tokens: torch.Tensor, lengths: torch.Tensor, groups: list, vocab: int) -> torch.Tensor:
    """The padded baseline: each micro-batch [rows, longest] through the model with a causal mask -> [N, S-1]."""
    from megarl.megatron.forward import causal_inputs
    from megarl.megatron.vocab_parallel import logprobs_from_logits

    out = torch.zeros(tokens.shape[0], tokens.shape[1] - 1)
    with torch.no_grad():
        for g in groups:
            s = int(lengths[g].max())
            ids = tokens[g, :s]
            pos, mask = causal_inputs(ids)
            logits = model(ids, pos, mask)
            out[g, : s - 1] = logprobs_from_logits(logits[:, : s - 1], ids[:, 1:], vocab)
    return out


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--median", type=int, default=48, help="median row length (tokens)")
    p.add_argument("--tail", type=float, default=16.0, help="longest row / median")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per fixed-size micro-batch")
    p.add_argument("--budget", type=int, default=0, help="real tokens per token-budget micro-batch (0: 2x longest)")
    p.add_argument("--multiple", type=int, default=1, help="pack length multiple (TP under sequence parallelism)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (one: on a shared CPU two threads time "
                   "their waits at OpenMP barriers more than the work)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from bench.bench_train import model_config
    from megarl.batching import forward_by_token_budget, token_budget_groups
    from megarl.bridge import spec_from_dict
    from megarl.distributed import init_distributed
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_distributed()
    init_model_parallel(Layout(), seed=0)
    lengths = long_tail_lengths(args.rows, args.median, args.tail, args.seed)
    n, longest = len(lengths), int(lengths.max())
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(1, args.vocab, (n, longest), generator=g)
    tokens[torch.arange(longest)[None, :] >= lengths[:, None]] = 0
    order = torch.randperm(n, generator=g)  # fixed-size micro-batches take rows in a random order
    tokens, lengths = tokens[order], lengths[order]
    fixed = [torch.arange(i, min(n, i + args.micro_batch)) for i in range(0, n, args.micro_batch)]
    budget = args.budget or 2 * longest
    by_budget = [torch.tensor(sorted(b)) for b in token_budget_groups(lengths.tolist(), budget)]
    real = int(lengths.sum())
    print(f"batch: {n} rows, lengths median {int(lengths.median())}, longest {longest} "
          f"({longest / float(lengths.median()):.1f}x the median), {real} real tokens")

    cfg = model_config(args.hidden, args.layers, args.vocab)
    spec = spec_from_dict(cfg)
    model = build_gpt_model(spec, dtype=torch.float32, use_te=False)
    model.eval()
    vocab = spec.vocab_size
    worst_packed = 0.0
    cases = {"fixed": (f"fixed micro-batches of {args.micro_batch} rows", fixed),
             "budget": (f"token-budget micro-batches of <= {budget} tokens", by_budget)}
    for name, (title, groups) in cases.items():
        padded_ratio, packed_ratio = token_ratios(groups, lengths, args.multiple)
        worst_packed = max(worst_packed, packed_ratio)
        if name == "fixed":
            packed_fn = lambda: token_logprobs(model, tokens, args.micro_batch, lengths=lengths)  # noqa: E731
        else:
            packed_fn = lambda: forward_by_token_budget(  # noqa: E731
                lambda x, mb, lens: token_logprobs(model, x, mb, lengths=lens), tokens, lengths, budget, longest - 1)
        t_pad, t_pack = float("inf"), float("inf")
        for _ in range(args.repeat):  # alternating, so a change of the machine's load hits both
            t, lp_pad = _timed(lambda: padded_logprobs(model, tokens, lengths, groups, vocab))
            t_pad = min(t_pad, t)
            t, lp_pack = _timed(packed_fn)
            t_pack = min(t_pack, t)
        mask = torch.arange(longest - 1)[None, :] < (lengths[:, None] - 1)
        diff = float((lp_pack - lp_pad).abs()[mask].max())
        print(f"{title} ({len(groups)}): computed / real tokens: padded {padded_ratio:.3f}, packed "
              f"{packed_ratio:.3f}")
        print(f"  log-prob pass, best of {args.repeat}: padded {t_pad:.3f} s, packed {t_pack:.3f} s: packed / padded "
              f"= {t_pack / t_pad:.2f} ({t_pad / t_pack:.2f}x faster); largest logprob difference {diff:.1e}")
    met = worst_packed <= PACKED_TARGET
    print(f"target: packed computed / real tokens <= {PACKED_TARGET}: {'MET' if met else 'SHORT'} "
          f"({worst_packed:.3f}); {args.threads} torch thread(s), load average {os.getloadavg()[0]:.1f} on "
          f"{os.cpu_count()} cores")
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
