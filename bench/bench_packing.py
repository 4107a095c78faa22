"""What the model actually computes per real token with packed micro-batches, counted from its own inputs, on a batch
with a long-tail length distribution; and the step time of packed vs padded micro-batches.

    python bench/bench_packing.py                           # every layout, then the step time (2 torch threads)
    python bench/bench_packing.py --layouts dp,ep2 --no-time  # counts only
    python bench/bench_packing.py --rows 128 --median 128 --hidden 512 --layers 4 --repeat 5

The batch's lengths are lognormal, scaled so that the longest row is exactly --tail (16) x the median.

Computed work is counted by hooks on the model while it runs the product's forward (megarl.megatron.forward:
token_logprobs over fixed micro-batches of --micro-batch rows, or forward_by_token_budget over token budgets), on
every rank of the layout, summed over ranks:
  - every megatron linear (ColumnParallelLinear / RowParallelLinear: q/k/v, projection, MLP, each expert's MLP, the
    output layer) adds 2 x rows x weight elements for the rows it receives; "tokens" are the rows entering each
    layer's first linear (linear_qkv), averaged over layers;
  - attention adds 2 x (query width + value width) per head for every query-key pair of the kernel calls it makes
    (torch's scaled_dot_product_attention: a causal call L (L + 1) / 2 pairs, else all; context parallelism's
    blocks, megarl.megatron.context_parallel.block_attention: every pair of a block).
Real work is derived by hand from the rows' lengths and the model's widths: every row alone, unpadded, its causal
attention L (L + 1) / 2 pairs, topk experts per token. computed / real > 1 is work spent on padding (end padding of
agreed pack sizes, rows padded to 2*CP, a padded batch's columns past each row) or on masked attention halves.

Layouts (each on its own ranks over gloo, TP1, float32; a Llama of --hidden and --layers, or for EP2 an MoE of the
same widths with 8 experts, top-2):
  dp   1 rank; fixed micro-batches and token budgets (--budget, default 2x the longest row);
  ep2  2 ranks, expert-parallel (DP2): rows dealt over the ranks by tokens (megarl.megatron.workers.rows_over_ranks),
       token budgets agreed over the group (expert_bins) and fixed micro-batches (fewest packs);
  vpp  2 ranks, PP2 x VPP2: fixed micro-batches (every pack of a call at one size: the fewest packs);
  cp2  2 ranks, context-parallel: fixed micro-batches and token budgets.
Beside "packed", each layout prints "as before" (EP2, VPP): the padding computed as one causal segment and sent to
the experts, contiguous rows per rank and the fixed micro-batches as given: what the layouts cost before the padding
was skipped and the packs balanced; and for DP "padded": each micro-batch as [rows, its longest row] with a causal
mask (the layout before packing). Both are counted by the same hooks, so a ratio above 1 is seen when padding is paid.

Step time (--no-time to skip; 1 rank, --threads torch threads): one PPO update step (megatron's schedule,
forward + backward + Adam) over the whole batch in fixed micro-batches of --micro-batch rows, packed (the product
path) against the same micro-batches padded to their longest row (the model on [rows, longest] with a causal mask,
the same loss on its padded logits), the same tokens and rows, alternating, best of --repeat each. Figures taken at a
load average above 2 are not figures: the load is printed with them.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

PACKED_TARGET = 1.05  # computed / real work of packed micro-batches, every layout
SPEEDUP_TARGET = 1.5  # padded / packed step time
LAYOUTS = {"dp": 1, "ep2": 2, "vpp": 2, "cp2": 2}


def long_tail_lengths(rows: int, median: int, tail: float, seed: int) -> torch.Tensor:
    """[rows] lognormal lengths with median `median` and the longest exactly `tail` x the median: `plan --measure
    --long-tail`'s batch (megarl.plan.measure.long_tail_lengths)."""
    from megarl.plan.measure import long_tail_lengths as lengths_of

    return torch.tensor(lengths_of(rows, int(round(tail * median)), tail, seed))


def batch_of(args) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [N, S] right-padded, lengths [N]) of the long-tail batch, rows in a random order."""
    lengths = long_tail_lengths(args.rows, args.median, args.tail, args.seed)
    n, longest = len(lengths), int(lengths.max())
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(1, args.vocab, (n, longest), generator=g)
    tokens[torch.arange(longest)[None, :] >= lengths[:, None]] = 0
    order = torch.randperm(n, generator=g)
    return tokens[order], lengths[order]


def model_dict(hidden: int, layers: int, vocab: int, moe: bool) -> dict:
    """config.json of the bench's model: a Llama, or a Qwen3-MoE of the same widths (8 experts, top-2)."""
    heads = max(1, hidden // 64)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=heads, vocab_size=vocab, max_position_embeddings=8192, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, rope_theta=10000.0, hidden_act="silu")
    if not moe:
        return dict(architectures=["LlamaForCausalLM"], model_type="llama",
                    intermediate_size=hidden * 8 // 3 // 64 * 64, **common)
    return dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", head_dim=64,
                intermediate_size=hidden * 8 // 3 // 64 * 64, moe_intermediate_size=max(64, hidden // 2),
                num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                **common)


def real_work(spec, lengths: torch.Tensor, vocab_rows: int) -> tuple[float, float]:
    """(FLOPs, tokens) of every row alone, unpadded: per token 2 x the weights of the linears it passes (q/k/v,
    projection, the dense MLP or topk experts' MLPs, the output layer of vocab_rows), per causal pair of each layer
    2 x heads x (query + value width)."""
    h, d, layers = spec.hidden_size, spec.head_dim, spec.num_layers
    nq, nkv = spec.num_attention_heads, spec.num_key_value_heads
    attention = h * (nq + 2 * nkv) * d + nq * d * h
    if spec.num_experts:
        mlp = spec.moe_topk * 3 * h * spec.moe_ffn_hidden_size
    else:
        mlp = 3 * h * spec.ffn_hidden_size
    per_token = 2.0 * (layers * (attention + mlp) + h * vocab_rows)
    per_pair = 2.0 * layers * nq * (d + d)
    tokens = float(lengths.sum())
    pairs = float((lengths * (lengths + 1) // 2).sum())
    return per_token * tokens + per_pair * pairs, tokens


class Counter:
    """Hooks on a model (its chunks) that add up what it computes: FLOPs of megatron's linears and of attention's
    query-key pairs, and the rows entering each layer's first linear."""

    def __init__(self, chunks: list):
        from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

        self.flops = 0.0
        self.qkv_rows = 0
        self.layers = 0
        self.handles = []
        for chunk in chunks:
            for name, module in chunk.named_modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    qkv = name.endswith("self_attention.linear_qkv")
                    self.layers += qkv
                    self.handles.append(module.register_forward_pre_hook(partial(self._linear, qkv)))
        self._patch()

    def _linear(self, qkv: bool, module, args):
        x = args[0]
        rows = x.numel() // x.shape[-1]
        self.flops += 2.0 * rows * module.weight.numel()
        if qkv:
            self.qkv_rows += rows

    def _patch(self):
        import torch.nn.functional as F

        from megarl.megatron import context_parallel

        sdpa, block = F.scaled_dot_product_attention, context_parallel.block_attention
        self._saved = (sdpa, block)

        def counting_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
            b, heads, sq, dq = q.shape
            sk = k.shape[-2]
            pairs = sq * (sq + 1) // 2 if is_causal else sq * sk
            self.flops += 2.0 * b * heads * pairs * (dq + v.shape[-1])
            return sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

        def counting_block(q, k, v, causal, scale, dropout=0.0):
            g, m, nq, dq = q.shape
            self.flops += 2.0 * g * m * k.shape[1] * nq * (dq + v.shape[-1])
            return block(q, k, v, causal, scale, dropout)

        F.scaled_dot_product_attention = counting_sdpa
        context_parallel.block_attention = counting_block

    def reset(self):
        self.flops, self.qkv_rows = 0.0, 0

    def result(self) -> dict:
        return {"flops": self.flops, "qkv_rows": self.qkv_rows, "layers": self.layers}


def _as_before():
    """The padding computed as before: one causal segment in attention, sent to the experts; fixed micro-batches as
    given (no fewest packs). Returns an undo function."""
    from megarl.megatron import forward, packing

    saved = (packing.attended, packing.padding_mask, forward.padding_mask, forward.fewest_rows)
    packing.attended = lambda params: (packing.segment_lengths(params), 0)
    packing.padding_mask = forward.padding_mask = lambda pack: None
    forward.fewest_rows = lambda groups, lengths, num_chunks: groups

    def undo():
        packing.attended, packing.padding_mask, forward.padding_mask, forward.fewest_rows = saved

    return undo


def _padded_logprobs(model, tokens, lengths, groups, vocab):
    """The padded micro-batches: each [rows, its longest] through the model with a causal mask."""
    from megarl.megatron.forward import causal_inputs
    from megarl.megatron.vocab_parallel import logprobs_from_logits

    with torch.no_grad():
        for g in groups:
            s = int(lengths[g].max())
            ids = tokens[g, :s]
            pos, mask = causal_inputs(ids)
            logits = model(ids, pos, mask)
            logprobs_from_logits(logits[:, : s - 1], ids[:, 1:], vocab)


def layout_rank(layout: str, cfg: dict, tokens: torch.Tensor, lengths: torch.Tensor, micro: int, budget: int,
                threads: int) -> dict:
    """One rank of a layout: {case: counts} of the forward-only passes this layout runs (see the module doc)."""
    torch.set_num_threads(threads)
    from megatron.core import parallel_state as ps

    from megarl.batching import forward_by_token_budget
    from megarl.bridge import spec_from_dict
    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_model_chunks
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.megatron.workers import expert_bins, rows_over_ranks

    layouts = {"dp": Layout(), "ep2": Layout(expert_model_parallel_size=2),
               "vpp": Layout(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
               "cp2": Layout(context_parallel_size=2)}
    init_model_parallel(layouts[layout], seed=0)
    spec = spec_from_dict(cfg)
    model = build_model_chunks(spec, dtype=torch.float32, use_te=False)
    chunks = model if isinstance(model, list) else [model]
    for chunk in chunks:
        chunk.eval()
    counter = Counter(chunks)
    dp, r = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    n = tokens.shape[0]

    def share(order):
        rows = torch.arange(n) if order is None else order
        per = n // dp
        mine = rows[r * per:(r + 1) * per]
        return tokens[mine], lengths[mine]

    def fixed(x, lens):
        return token_logprobs(model, x, micro, lengths=lens)

    def by_budget(x, lens, bins):
        return forward_by_token_budget(lambda t, mb, ln: token_logprobs(model, t, mb, lengths=ln), x, lens, budget,
                                       x.shape[1] - 1, bins=bins)

    out = {}

    def run(case, fn):
        counter.reset()
        with torch.no_grad():
            fn()
        out[case] = counter.result()

    balanced = share(rows_over_ranks(lengths, dp))
    run("packed, fixed", lambda: fixed(*balanced))
    if layout != "vpp":  # the interleaved schedule refuses token budgets' varying micro-batch counts
        run("packed, budget", lambda: by_budget(*balanced, expert_bins(
            [int(x) for x in balanced[1].tolist()], budget)))
    if layout in ("ep2", "vpp"):
        undo = _as_before()
        try:
            run("as before, fixed", lambda: fixed(*share(None)))
        finally:
            undo()
    if layout == "dp":
        groups = [torch.arange(i, min(n, i + micro)) for i in range(0, n, micro)]
        run("padded, fixed", lambda: _padded_logprobs(model, tokens, lengths, groups, spec.vocab_size))
    last = chunks[-1]
    out["vocab_rows"] = int(last.output_layer.weight.shape[0]) if last.post_process else 0
    return out


def count_layout(layout: str, args, tokens, lengths) -> dict:
    """{case: (computed / real FLOPs, computed / real tokens)} of a layout, summed over its ranks."""
    from megarl.bridge import spec_from_dict
    from megarl.launch_local import run_ranks

    cfg = model_dict(args.hidden, args.layers, args.vocab, moe=layout == "ep2")
    budget = args.budget or 2 * int(lengths.max())
    kwargs = dict(layout=layout, cfg=cfg, tokens=tokens, lengths=lengths, micro=args.micro_batch, budget=budget,
                  threads=1)
    env = {"PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    ranks = run_ranks("bench.bench_packing:layout_rank", LAYOUTS[layout], kwargs, timeout=1800, env=env)
    spec = spec_from_dict(cfg)
    vocab_rows = max(r["vocab_rows"] for r in ranks)
    real_flops, real_tokens = real_work(spec, lengths, vocab_rows)
    out = {}
    for case in ranks[0]:
        if case == "vocab_rows":
            continue
        flops = sum(r[case]["flops"] for r in ranks)
        tokens_in = sum(r[case]["qkv_rows"] for r in ranks) / spec.num_layers
        out[case] = (flops / real_flops, tokens_in / real_tokens)
    return out


# ---- step time: packed vs padded micro-batches, one rank ----

def _padded_forward_step(loss_fn, scale, data_iterator, model):
    """megatron's forward-step contract for the padded baseline: the micro-batch [b, S] (cut to its longest row)
    through the model with a causal mask; its logits [b, S, V] read as a pack of full-width rows."""
    from megarl import distributed
    from megarl.megatron.forward import causal_inputs
    from megarl.megatron.packing import pack_rows
    from megarl.megatron.train_step import _scaled_loss

    mb = distributed.to_device(next(data_iterator))
    pos, mask = causal_inputs(mb["input_ids"])
    out = distributed.call_model(model, mb["input_ids"], pos, mask)
    full = {**mb, "pack": pack_rows(mb["input_ids"])}
    return out, lambda output: partial(_scaled_loss, loss_fn, scale, full)(output.reshape(1, -1, output.shape[-1]))


def time_steps(args, tokens, lengths) -> dict:
    """{"packed": s, "padded": s}: best of --repeat PPO update steps each, alternating (one process, this one)."""
    torch.set_num_threads(args.threads)
    from megarl.bridge import spec_from_dict
    from megarl.config.schema import OptimConfig
    from megarl.distributed import init_distributed
    from megarl.megatron import train_step
    from megarl.megatron.losses import PolicyLoss, PolicyLossSettings
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_distributed()
    init_model_parallel(Layout(), seed=0)
    spec = spec_from_dict(model_dict(args.hidden, args.layers, args.vocab, moe=False))
    model = build_gpt_model(spec, dtype=torch.float32, use_te=False)
    trainable = train_step.make_trainable(model, OptimConfig(lr=1e-6, weight_decay=0.0, clip_grad=1.0),
                                          total_steps=1000)
    n, s = tokens.shape
    cols = torch.arange(s - 1)[None, :]
    mask = (cols >= (lengths[:, None] // 2 - 1)) & (cols < lengths[:, None] - 1)  # responses: each row's second half
    g = torch.Generator().manual_seed(args.seed + 2)
    batch = {"input_ids": tokens, "response_mask": mask, "old_log_probs": torch.zeros(n, s - 1),
             "advantages": torch.randn(n, s - 1, generator=g)}
    micro = []
    for i in range(0, n, args.micro_batch):
        rows = slice(i, min(n, i + args.micro_batch))
        width = int(lengths[rows].max())  # each micro-batch cut to its longest row (what padding computes)
        micro.append({k: (v[rows, :width] if k == "input_ids" else v[rows, :width - 1]) for k, v in batch.items()})
    settings = PolicyLossSettings(vocab_size=spec.vocab_size)
    denominator = train_step.loss_denominator([m["response_mask"] for m in micro], settings.loss_agg_mode)
    packed_step = train_step.forward_step
    best = {"packed": float("inf"), "padded": float("inf")}
    for _ in range(args.repeat + 1):  # the first round warms both up and is not counted
        for name, step in (("packed", packed_step), ("padded", _padded_forward_step)):
            train_step.forward_step = step
            start = time.perf_counter()
            train_step.train_mini_batch(trainable, micro, PolicyLoss(settings, denominator))
            elapsed = time.perf_counter() - start
            if _ > 0:
                best[name] = min(best[name], elapsed)
    train_step.forward_step = packed_step
    return best


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--median", type=int, default=48, help="median row length (tokens)")
    p.add_argument("--tail", type=float, default=16.0, help="longest row / median")
    p.add_argument("--micro-batch", type=int, default=8, help="rows per fixed-size micro-batch")
    p.add_argument("--budget", type=int, default=0, help="tokens per token-budget micro-batch (0: 2x longest)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma-separated: " + ", ".join(LAYOUTS))
    p.add_argument("--repeat", type=int, default=3, help="timed steps of each kind (after one warm-up each)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the timed steps")
    p.add_argument("--no-time", action="store_true", help="counts only, no step time")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    tokens, lengths = batch_of(args)
    longest, real = int(lengths.max()), int(lengths.sum())
    print(f"batch: {len(lengths)} rows, lengths median {int(lengths.median())}, longest {longest} "
          f"({longest / float(lengths.median()):.1f}x the median), {real} real tokens; fixed micro-batches of "
          f"{args.micro_batch} rows, token budgets of {args.budget or 2 * longest}")
    worst = 0.0
    for layout in [x for x in args.layouts.split(",") if x]:
        for case, (flops, tokens_ratio) in count_layout(layout, args, tokens, lengths).items():
            print(f"{layout:4s} {case:18s} computed / real: FLOPs {flops:.3f}, tokens into the GEMMs "
                  f"{tokens_ratio:.3f}")
            if case.startswith("packed"):
                worst = max(worst, flops, tokens_ratio)
    met = worst <= PACKED_TARGET
    if args.layouts:
        print(f"target: packed computed / real <= {PACKED_TARGET} in every layout: {'MET' if met else 'SHORT'} "
              f"({worst:.3f})")
    if not args.no_time:
        before = os.getloadavg()[0]
        best = time_steps(args, tokens, lengths)
        speedup = best["padded"] / best["packed"]
        after = os.getloadavg()[0]
        # the bench's own threads add up to --threads to the load average while it runs: the load before it is the
        # machine's
        print(f"PPO update step, {args.threads} torch threads, best of {args.repeat}: packed {best['packed']:.3f} s, "
              f"padded to each micro-batch's longest row {best['padded']:.3f} s: {speedup:.2f}x "
              f"(target >= {SPEEDUP_TARGET}: {'MET' if speedup >= SPEEDUP_TARGET else 'SHORT'}); load average "
              f"{before:.1f} before the steps, {after:.1f} after (its own threads included) on {os.cpu_count()} "
              "cores" + ("" if before < 2 else " (above 2 before: not a figure)"))
        met = met and speedup >= SPEEDUP_TARGET
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
