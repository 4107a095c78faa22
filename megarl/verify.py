"""`megarl verify --hf DIR [--tp N --pp N --ep N] [--tol X]`: logprob parity of megarl's megatron model with HF.

Loads the HF checkpoint into megarl at the given layout, computes per-token logprobs of a batch of sequences (text from
the checkpoint's tokenizer, right-padded to different lengths; random ids when there is no tokenizer), computes the same
with HF transformers (float32, eager attention), prints a table per sequence and the max absolute difference over real
tokens, and returns 1 when it exceeds the tolerance.

Ranks. As a plain command (no WORLD_SIZE in the environment) it starts the ranks itself with
megarl.launch_local.run_ranks: world size = TP * PP * EP, i.e. data parallel size = EP (megatron's expert-parallel group
is carved out of the TP * DP ranks of a stage, with expert TP = TP). Under torchrun it uses the ranks it is given
(the world size must be a multiple of TP * PP, with DP divisible by EP); every DP replica computes the same batch and
global rank 0 prints.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

import torch

TEXTS = [
    "The quick brown fox jumps over the lazy dog. Reinforcement learning from verifiable rewards trains a policy.",
    "Question: what is 12 * 7? Let us think step by step. 12 * 7 = 84, so the answer is 84.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # prints 5",
    "Megatron shards the weights over tensor, pipeline and expert parallel ranks; vLLM generates rollouts.",
]


def world_size_for(tp: int, pp: int, ep: int, engine_tp: int = 1) -> int:
    """Ranks a plain `megarl verify` starts: TP * PP * EP (data parallel = EP), or more when the engine's TP needs
    more ranks to host its workers (the extra ranks are data-parallel replicas)."""
    world = tp * pp * ep
    while world < engine_tp:
        world += tp * pp * ep
    return world


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="megarl verify", description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="Hugging Face model directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--tp", type=int, default=1, help="tensor_model_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="pipeline_model_parallel_size")
    p.add_argument("--ep", type=int, default=1, help="expert_model_parallel_size (MoE)")
    p.add_argument("--first-stage-layers", type=int, default=None,
                   help="uneven pipeline stages: num_layers_in_first_pipeline_stage")
    p.add_argument("--last-stage-layers", type=int, default=None,
                   help="uneven pipeline stages: num_layers_in_last_pipeline_stage")
    p.add_argument("--tol", type=float, default=None,
                   help="max abs logprob difference allowed (default 1e-5 in float32, 0.5 in bfloat16)")
    p.add_argument("--batch", type=int, default=4, help="number of sequences")
    p.add_argument("--seq-len", type=int, default=64, help="padded sequence length")
    p.add_argument("--micro-batch", type=int, default=1, help="micro-batch size of the megatron forward")
    p.add_argument("--seed", type=int, default=0, help="seed of the random token ids (no tokenizer) and model init")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="megatron parameter dtype")
    p.add_argument("--engine", choices=["megatron", "vllm"], default="megatron",
                   help="megatron: compare megarl's logprobs with HF transformers; vllm: also push megarl's weights "
                   "into a vLLM engine started with random weights and compare vLLM's logprobs with megarl's")
    p.add_argument("--engine-tp", type=int, default=1, help="with --engine vllm: the engine's tensor parallel size "
                   "(its workers are hosted by trainer ranks 0..engine_tp-1 and each receives only its shard)")
    p.add_argument("--engine-ep", type=int, default=1, help="with --engine vllm: the engine's expert parallel size "
                   "(1, or equal to --engine-tp)")
    p.add_argument("--timeout", type=float, default=1800, help="seconds before the started ranks are killed")
    args = p.parse_args(argv)
    if args.tol is None:
        args.tol = (1e-4 if args.engine == "vllm" else 1e-5) if args.dtype == "float32" else 0.5
    return args


def make_batch(hf_dir: str, vocab_size: int, batch: int, seq_len: int, seed: int = 0) -> tuple:
    """(tokens [batch, seq_len] right-padded, lengths [batch], source) from the tokenizer, else random ids."""
    lengths = torch.tensor([max(2, seq_len - i * seq_len // (2 * batch)) for i in range(batch)])
    tokens = torch.zeros(batch, seq_len, dtype=torch.long)
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(hf_dir)
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        tokens.fill_(pad)
        for i in range(batch):
            ids: list = []
            j = i
            while len(ids) < lengths[i]:
                ids += tok(TEXTS[j % len(TEXTS)] + " ", add_special_tokens=False)["input_ids"]
                j += 1
            tokens[i, : lengths[i]] = torch.tensor(ids[: lengths[i]])
        if int(tokens.max()) >= vocab_size:
            raise ValueError(f"the tokenizer produces id {int(tokens.max())} >= vocab_size={vocab_size}")
        return tokens, lengths, "tokenizer"
    except Exception as exc:  # no or unusable tokenizer: random ids still verify the weights
        g = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
        for i in range(batch):
            tokens[i, lengths[i]:] = 0
        return tokens, lengths, f"random ids ({type(exc).__name__}: {exc})"


def megatron_logprobs(hf_dir: str, tokens: torch.Tensor, tp: int = 1, pp: int = 1, ep: int = 1,
                      micro_batch: int = 1, dtype: str = "float32", seed: int = 0, engine: str = "megatron",
                      lengths: Optional[torch.Tensor] = None, engine_tp: int = 1, engine_ep: int = 1,
                      first_stage: Optional[int] = None, last_stage: Optional[int] = None) -> dict:
    """Rank body (after init_distributed): {"megatron": megarl's logprobs [B, S-1] on the rank that reports them
    (last pipeline stage, TP rank 0, DP rank 0), else None}; with engine="vllm", rank 0 adds "vllm" (per-sequence
    logprob lists of the real tokens) and "sync" (weight-sync metrics)."""
    from megatron.core import parallel_state as ps

    from megarl.megatron.forward import token_logprobs
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               expert_model_parallel_size=ep, num_layers_in_first_pipeline_stage=first_stage,
                               num_layers_in_last_pipeline_stage=last_stage), seed=seed)
    model, spec = build_and_load(hf_dir, dtype=getattr(torch, dtype))
    model.eval()
    out = token_logprobs(model, tokens, micro_batch_size=micro_batch)
    report = (out is not None and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0)
    result = {"megatron": out.cpu() if report else None}
    if engine == "vllm":
        result.update(_engine_logprobs(model, spec, hf_dir, tokens, lengths, dtype, engine_tp, engine_ep))
    return result


def _engine_logprobs(model, spec, hf_dir: str, tokens: torch.Tensor, lengths: torch.Tensor, dtype: str,
                     engine_tp: int = 1, engine_ep: int = 1) -> dict:
    """Rank 0 starts a vLLM engine (TP engine_tp, EP engine_ep) with random (dummy) weights; every rank delivers
    megarl's weights into it through the trainer's weight sync (each engine worker receives its own shard from the
    ranks that hold it; checksums verified on every worker); rank 0 returns vLLM's logprobs of the batch."""
    import torch.distributed as dist

    from megarl.config.schema import RolloutConfig
    from megarl.sync.delivery import plan_sync
    from megarl.rollout.process import EngineProcess
    from megarl.rollout.replicas import EngineTopology

    engine = None
    if dist.get_rank() == 0:
        cfg = RolloutConfig(prompt_length=tokens.shape[1], response_length=1, load_format="dummy", dtype=dtype,
                            enable_prefix_caching=False, tensor_model_parallel_size=engine_tp,
                            expert_model_parallel_size=engine_ep)
        engine = EngineProcess(cfg, hf_dir, seed=0)
    try:
        sync = plan_sync(model, spec, engine, EngineTopology(dist.get_world_size(), engine_tp, 1), 64 << 20).run(
            engine, verify=True)
        if engine is None:
            return {}
        seqs = [tokens[i, :n].tolist() for i, n in enumerate(lengths.tolist())]
        return {"vllm": engine.sequence_logprobs(seqs), "sync": sync}
    finally:
        if engine is not None:
            engine.shutdown()


def hf_logprobs(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    """HF transformers logprobs [B, S-1], float32, eager attention, on the CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)


def compare(reference: torch.Tensor, got: torch.Tensor, lengths: torch.Tensor) -> tuple:
    """(max abs diff over real tokens, [(seq, n_tokens, max diff, mean ref logprob)]) ."""
    rows = []
    for i, n in enumerate(lengths.tolist()):
        d = (got[i, : n - 1].float() - reference[i, : n - 1]).abs()
        rows.append((i, n, d.max().item() if n > 1 else 0.0, reference[i, : n - 1].mean().item()))
    return max(r[2] for r in rows), rows


def report(args, rows, max_diff, source, out=None, reference: str = "HF", other: str = "megarl") -> int:
    out = out or sys.stdout
    engine = f"vllm (TP{args.engine_tp} EP{args.engine_ep})" if args.engine == "vllm" else args.engine
    stages = ("" if args.first_stage_layers is None and args.last_stage_layers is None else
              f" (stages first={args.first_stage_layers} last={args.last_stage_layers})")
    print(f"megarl verify {args.hf}  TP={args.tp} PP={args.pp}{stages} EP={args.ep} dtype={args.dtype} engine={engine}  "
          f"batch from {source}", file=out)
    print(f"{'seq':>4} {'tokens':>6} {'max|diff|':>11} {'mean ' + reference + ' logprob':>16}", file=out)
    for i, n, d, mean in rows:
        print(f"{i:>4} {n:>6} {d:>11.3e} {mean:>16.4f}", file=out)
    ok = max_diff <= args.tol
    print(f"max abs logprob difference {max_diff:.3e} ({other} vs {reference}, tolerance {args.tol:.1e}): "
          f"{'OK' if ok else 'FAILED'}", file=out)
    if not ok:
        print(f"error: {other}'s logprobs differ from {reference}'s by {max_diff:.3e} > --tol {args.tol:.1e}; the "
              "checkpoint may use a feature the bridge maps incorrectly (report it with this output)", file=out)
    return 0 if ok else 1


def _rank_body(**kwargs):
    return megatron_logprobs(**kwargs)


def main(argv: Optional[Sequence[str]] = None) -> int:
    from megarl.bridge.hf_config import BridgeError, check_layout, load_spec

    args = parse_args(argv)
    try:
        spec = load_spec(args.hf)
        if spec.score_head:
            raise BridgeError(f"{args.hf}: {spec.architecture} is a value/reward model; verify compares the "
                              "logprobs of causal LMs")
        check_layout(spec, args.tp, args.pp, args.ep, first_stage=args.first_stage_layers,
                     last_stage=args.last_stage_layers)
    except BridgeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokens, lengths, source = make_batch(args.hf, spec.vocab_size, args.batch, args.seq_len, args.seed)
    kwargs = dict(hf_dir=str(args.hf), tokens=tokens, tp=args.tp, pp=args.pp, ep=args.ep,
                  micro_batch=args.micro_batch, dtype=args.dtype, seed=args.seed, engine=args.engine, lengths=lengths,
                  engine_tp=args.engine_tp, engine_ep=args.engine_ep, first_stage=args.first_stage_layers,
                  last_stage=args.last_stage_layers)
    if "WORLD_SIZE" in os.environ:  # under torchrun: use the ranks we were given
        import torch.distributed as dist

        from megarl.megatron.parallel import init_distributed

        init_distributed()
        mine = megatron_logprobs(**kwargs)
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        code = torch.tensor([0])
        if dist.get_rank() == 0:
            code[0] = _judge(args, gathered, tokens, lengths, source)
        dist.broadcast(code, src=0)
        return int(code.item())
    from megarl.launch_local import RankFailure, run_ranks

    world = world_size_for(args.tp, args.pp, args.ep, args.engine_tp if args.engine == "vllm" else 1)
    try:
        results = run_ranks("megarl.verify:_rank_body", world, kwargs, timeout=args.timeout)
    except RankFailure as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _judge(args, results, tokens, lengths, source)


def _judge(args, results: list, tokens: torch.Tensor, lengths: torch.Tensor, source: str) -> int:
    """Compare megatron with HF (engine=megatron) or vLLM with megatron (engine=vllm); print the table; exit code."""
    got = next(r["megatron"] for r in results if r.get("megatron") is not None)
    if args.engine == "megatron":
        max_diff, rows = compare(hf_logprobs(args.hf, tokens), got, lengths)
        return report(args, rows, max_diff, source)
    engine = next(r for r in results if "vllm" in r)
    vllm = torch.zeros_like(got)
    for i, row in enumerate(engine["vllm"]):
        vllm[i, : len(row)] = torch.tensor(row)
    hf_diff, _ = compare(hf_logprobs(args.hf, tokens), got, lengths)
    sync = engine["sync"]
    print(f"weight sync into vLLM (engine TP{args.engine_tp} EP{args.engine_ep}): "
          f"{sync['weight_sync/num_tensors']:.0f} tensors, {sync['weight_sync/bytes'] / 2**20:.1f} MiB in "
          f"{sync['weight_sync/seconds']:.2f} s, {sync['weight_sync/verified_tensors']:.0f} engine tensors' checksums "
          f"verified; "
          f"megarl vs HF transformers: {hf_diff:.3e}")
    max_diff, rows = compare(got, vllm, lengths)  # reference: megarl's own logprobs
    return report(args, rows, max_diff, source, reference="megarl", other="vLLM")


if __name__ == "__main__":
    sys.exit(main())
