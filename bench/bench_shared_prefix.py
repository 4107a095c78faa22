"""An actor update on a GRPO-shaped batch with shared prefixes (model.share_prefixes) against the same update with
every row packed whole, in the same run.

    python bench/bench_shared_prefix.py                  # SmolLM2-135M's widths, 8 prompts x 8 samples, budget 2048
    python bench/bench_shared_prefix.py --prompts 16 --n 4 --prompt-len 200 --response-median 400 --repeat 2

The batch: --prompts prompts of --prompt-len random tokens, each with --n samples whose response lengths are
lognormal with median --response-median and the longest --tail x it (at least 1). Both sides cut it into token-budget
micro-batches of at most --budget computed tokens as the actor does (actor.use_dynamic_bsz: rows packed whole by
megarl.batching.token_budget_groups; shared by megarl.megatron.shared_prefix.budget_bins) and run one update
(megarl.megatron.train_step.train_mini_batch with the PPO loss, Adam at lr 1e-12: the weights stay put), alternately,
best of --repeat each. Printed: computed / real tokens for each side, the update's seconds and their ratio, and the
largest difference of the per-token logprobs between the two sides' forward passes (the same model; rounding only).
One process, TP1, float32, random weights of the model's shape (the timing does not depend on the values).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

# SmolLM2-135M-Instruct's config.json widths (the real recipe's model)
SMOLLM2 = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=576, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536, vocab_size=49152,
               max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True, rope_theta=100000.0,
               hidden_act="silu")


def grpo_batch(prompts: int, n: int, prompt_len: int, median: int, tail: float, vocab: int, seed: int) -> dict:
    """input_ids [P*n, S] (right-padded), response_mask [P*n, S-1], advantages and on-policy old logprobs (zeros:
    only the timing and the logprob comparison read this batch)."""
    from bench.bench_packing import long_tail_lengths

    g = torch.Generator().manual_seed(seed)
    lengths = long_tail_lengths(prompts * n, median, tail, seed).clamp(min=1)
    s = prompt_len + int(lengths.max())
    ids = torch.zeros(prompts * n, s, dtype=torch.long)
    mask = torch.zeros(prompts * n, s - 1, dtype=torch.bool)
    for p in range(prompts):
        prompt = torch.randint(1, vocab, (prompt_len,), generator=g)
        for j in range(n):
            r = p * n + j
            n_resp = int(lengths[r])
            ids[r, :prompt_len] = prompt
            ids[r, prompt_len:prompt_len + n_resp] = torch.randint(1, vocab, (n_resp,), generator=g)
            mask[r, prompt_len - 1:prompt_len + n_resp - 1] = True
    return {"input_ids": ids, "response_mask": mask, "advantages": torch.randn(mask.shape, generator=g),
            "old_log_probs": torch.zeros(mask.shape)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8, help="samples per prompt (rollout.n)")
    p.add_argument("--prompt-len", type=int, default=85, help="prompt tokens (the real recipe's: about 85)")
    p.add_argument("--response-median", type=int, default=30)
    p.add_argument("--tail", type=float, default=4.0, help="longest response / median")
    p.add_argument("--budget", type=int, default=2048, help="computed tokens per micro-batch (ppo_max_token_len)")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    from megarl.batching import sequence_lengths, split_by_token_budget
    from megarl.bridge import spec_from_dict
    from megarl.config.schema import OptimConfig
    from megarl.distributed import init_distributed
    from megarl.megatron import shared_prefix, train_step
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.packing import pack_size
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_distributed()
    init_model_parallel(Layout(), seed=0)
    cfg = dict(SMOLLM2, **({"num_hidden_layers": args.layers} if args.layers else {}))
    spec = spec_from_dict(cfg)
    model = build_gpt_model(spec, dtype=torch.float32, use_te=False)
    trainable = train_step.make_trainable(model, OptimConfig(lr=1e-12, weight_decay=0.0, clip_grad=0.0), total_steps=10)
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    batch = grpo_batch(args.prompts, args.n, args.prompt_len, args.response_median, args.tail, spec.vocab_size,
                       args.seed)
    lengths = sequence_lengths(batch)
    real = int(lengths.sum())
    sides = {}
    for share in (False, True):
        bins = shared_prefix.budget_bins(batch["input_ids"], lengths, args.budget) if share else None
        micro = split_by_token_budget(batch, args.budget, bins)
        computed = sum(pack_size(sequence_lengths(m), tokens=m["input_ids"] if share else None) for m in micro)
        sides[share] = (micro, computed)
    print(f"batch: {args.prompts} prompts x {args.n} samples, prompt {args.prompt_len} tokens, responses median "
          f"{args.response_median} (longest {int(lengths.max()) - args.prompt_len}), {real} real tokens; "
          f"{cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, vocab {cfg['vocab_size']}")
    for share, (micro, computed) in sides.items():
        print(f"  {'shared' if share else 'whole rows'}: {len(micro)} micro-batches, computed / real tokens "
              f"{computed / real:.3f}")

    def update(share: bool) -> float:
        shared_prefix.enable(model, share)
        micro = sides[share][0]
        denominator = train_step.loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
        start = time.perf_counter()
        train_step.train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
        return time.perf_counter() - start

    best = {False: float("inf"), True: float("inf")}
    update(False)  # warm-up: allocator, first-call costs
    for _ in range(args.repeat):  # alternating, so a change of the machine's load hits both
        for share in (False, True):
            best[share] = min(best[share], update(share))
    model.eval()
    logprobs = {}
    with torch.no_grad():
        for share in (False, True):
            shared_prefix.enable(model, share)
            logprobs[share] = token_logprobs(model, batch["input_ids"], args.prompts * args.n, lengths=lengths)
    diff = float((logprobs[True] - logprobs[False]).abs()[batch["response_mask"]].max())
    print(f"update, best of {args.repeat}: whole rows {best[False]:.2f} s, shared {best[True]:.2f} s: shared / whole "
          f"= {best[True] / best[False]:.2f} ({best[False] / best[True]:.2f}x faster); computed tokens "
          f"{sides[True][1] / sides[False][1]:.2f}x; largest response logprob difference {diff:.1e}")
    print(f"{torch.get_num_threads()} torch thread(s), load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} "
          "cores")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
