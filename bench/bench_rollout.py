"""Rollout benchmark, one run, side-by-side ratios:

1. weight sync as `megarl train` runs it, of a >= 100M-parameter Llama in rollout.update_weights_bucket_megabytes
   buckets: at engine TP T, T trainer ranks (processes over gloo, holding the model in Megatron's layout) each write
   their own engine worker's shard into its bucket files (megarl.sync.transports.colocated.WeightSync) and rank 0 owns
   the engine process; against the floor: rank 0 copying the same bytes into preallocated in-memory buffers with every
   core's threads, between syncs. At engine TP1 and TP2, with vLLM's prepacked CPU weights
   (rollout.cpu_prepack_weights=true, the default: bucket files, each layer rebuilt and re-packed) and with plain
   weights (false: each trainer rank writes its shards straight into its engine worker's parameters,
   megarl.sync.placement); each engine's decoding tokens/s on the same prompts shows what the packing buys.
2. rollout throughput: vLLM generated tokens/s against HF transformers `generate` on the same model and prompts
   (greedy, ignore EOS, the same number of new tokens, the same torch threads, both in --dtype). The engine's threads
   are planned as in the trainer's engine process (megarl.rollout.threads: every core this process may use); both are
   timed again at one thread (what the engine ran with when left to vLLM's and torchrun's defaults). The runs
   alternate and the best of --gen-repeats is kept, so load from other processes hits every contender alike.

    .venv/bin/python bench/bench_rollout.py                  # ~110M params, fp32 on CPU (about 2 minutes on 2 cores)
    .venv/bin/python bench/bench_rollout.py --hidden 256 --layers 2 --vocab 4096   # a quick smoke run
    .venv/bin/python bench/bench_rollout.py --sync-only --engine-tp 2 --weights plain   # one sync case
    .venv/bin/python bench/bench_rollout.py --rollout-only --dtype bfloat16   # both contenders in bf16
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

SET_THREADS = torch.set_num_threads  # vLLM's CPU worker replaces it with a no-op once started


def make_model(path: Path, hidden: int, layers: int, ffn: int, vocab: int, heads: int) -> int:
    """A random Llama plus a word-level tokenizer covering the whole vocabulary; returns the parameter count."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="t0", pad_token="t1", unk_token="t1").save_pretrained(path)
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, head_dim=hidden // heads, vocab_size=vocab,
                      max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=0, pad_token_id=1,
                      bos_token_id=None)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def trainer_rank(rank: int, world: int, port: int, path: str, cfg, repeats: int, cores: list, prompts: list,
                 out) -> None:
    """One trainer rank of the engine-replica sync as `megarl train` runs it: ranks hold the model in Megatron's
    layout (trainer TP1, so every rank holds every tensor, as at data parallel 2), rank r hosts engine worker r and
    writes that worker's shard of each tensor into its bucket files (megarl.sync.transports.colocated.WeightSync); rank
    0 owns the engine process. Rank 0 times each sync and, between syncs (the other ranks waiting), the in-memory copy
    floor of the same bytes at every core's thread, then decodes `prompts`; puts ([(metrics, floor seconds)], decoding
    tokens/s) on `out`."""
    import torch.distributed as dist

    from megarl.bridge.hf_config import load_spec
    from megarl.bridge.mapping import Mapping
    from megarl.bridge.sharding import LocalParam
    from megarl.sync.transports.colocated import plan_sync
    from megarl.sync.holdings import gather_holdings
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.layout import EngineTopology
    from safetensors.torch import load_file

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    rank_threads = max(1, len(cores) // world)  # as megarl's launcher sets OMP_NUM_THREADS per rank
    torch.set_num_threads(rank_threads)
    mapping = Mapping(load_spec(path))
    hf = load_file(str(Path(path) / "model.safetensors"))
    local, tp_info, dtypes = {}, {}, {}
    for entry in mapping.entries:
        if not all(h in hf for h in entry.hf):
            continue
        param = torch.nn.Parameter(mapping.to_megatron(entry, [hf[h] for h in entry.hf]).contiguous() * 1.01,
                                   requires_grad=False)
        local[entry.megatron] = LocalParam(entry.megatron, entry.megatron, param, False, 0, 1, None)
        tp_info[entry.megatron], dtypes[entry.megatron] = (0, 1), str(param.dtype).replace("torch.", "")
    engine = EngineProcess(cfg, path, cores=cores) if rank == 0 else None
    sync = plan_sync(gather_holdings(mapping, local, tp_info, dtypes), engine, EngineTopology(world, world, 1),
                     cfg.update_weights_bucket_megabytes << 20)
    # the floor's source and destination: rank 0 only
    src = list(hf.values()) if rank == 0 else []
    dst = [torch.empty_like(v) for v in src]
    del hf

    def floor() -> float:
        torch.set_num_threads(len(cores))
        t0 = time.perf_counter()
        for d, v in zip(dst, src):
            d.copy_(v)
        seconds = time.perf_counter() - t0
        torch.set_num_threads(rank_threads)
        return seconds

    if rank == 0:
        floor()  # first touch of the destination pages
    runs = []
    for _ in range(repeats):
        m = sync.run(engine)
        dist.barrier()
        runs.append((m, floor() if rank == 0 else 0.0))
        dist.barrier()
    if engine is not None:
        engine.generate(prompts[:1], n=1)  # warm-up
        t0 = time.perf_counter()
        batch = engine.generate(prompts)  # rollout.n samples each
        rate = int(batch.response_lengths.sum()) / (time.perf_counter() - t0)
        engine.shutdown()
        out.put((runs, rate))
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--samples", type=int, default=1, help="samples per prompt (rollout.n); > 1 samples at "
                    "temperature 1 (vLLM computes each prompt once and shares it, HF generate expands the batch first)")
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="weight syncs timed per engine (best is reported; the "
                    "first one or two also warm the shared-memory slot files)")
    ap.add_argument("--gen-repeats", type=int, default=2, help="generation rounds timed (best is reported)")
    ap.add_argument("--engine-tp", default="1,2", help="engine TP sizes of the sync section (comma-separated)")
    ap.add_argument("--weights", default="prepacked,plain", help="CPU engine weights of the sync section: prepacked "
                    "(rollout.cpu_prepack_weights=true), plain (false), hf (the transformers engine, rollout.name=hf, "
                    "engine TP1 only; `--weights plain,hf --engine-tp 1` compares it with vLLM's in-place sync), or "
                    "several, comma-separated")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--sync-only", action="store_true", help="only the weight sync section")
    only.add_argument("--rollout-only", action="store_true", help="only the rollout sections (2 and 3)")
    only.add_argument("--delta", action="store_true", help="instead: delta vs full updates into an engine placed apart "
                      "(bench/bench_delta.py; its own options follow --delta)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of both contenders in "
                    "the rollout sections (the sync section moves float32); bfloat16 needs a CPU with bf16 "
                    "instructions (AVX-512 BF16 or AMX) to be fast")
    args, rest = ap.parse_known_args()
    if args.delta:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from bench_delta import main as delta_main

        delta_main(rest)
        return 0
    if rest:
        ap.error(f"unrecognized arguments: {' '.join(rest)}")

    from megarl.config.schema import RolloutConfig
    from megarl.rollout import VLLMEngine
    from megarl.rollout.threads import apply_engine_threads, available_cores

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        t0 = time.perf_counter()
        nparams = make_model(path, args.hidden, args.layers, args.ffn, args.vocab, args.heads)
        print(f"model: Llama {nparams / 1e6:.1f}M params (fp32), built in {time.perf_counter() - t0:.1f}s", flush=True)
        seqs = args.prompts * args.samples
        kv_bytes = 2 * args.layers * args.hidden * 4 * (args.prompt_len + args.new_tokens) * seqs
        cfg = RolloutConfig(prompt_length=args.prompt_len, response_length=args.new_tokens, dtype="float32",
                            kv_cache_memory_bytes=max(128 << 20, int(kv_bytes * 1.25)), max_num_seqs=max(seqs, 1),
                            do_sample=args.samples > 1, temperature=1.0, n=args.samples, ignore_eos=True,
                            update_weights_bucket_megabytes=args.bucket_mb)

        nbytes = nparams * 4  # what a sync moves: every fp32 parameter once (the head is tied to the embedding)

        # -- 1. weight sync into engine processes vs the in-memory copy floor ----------------------------------------
        from megarl.distributed import free_port
        from megarl.rollout.hosting.process import EngineProcess

        g = torch.Generator().manual_seed(1)
        prompts = torch.randint(2, args.vocab, (args.prompts, args.prompt_len), generator=g)
        cores = available_cores()

        sync_ratio, sync_seconds = {}, {}
        ctx = torch.multiprocessing.get_context("spawn")
        for tp in ([] if args.rollout_only else [int(t) for t in args.engine_tp.split(",")]):
            for prepack in ({"prepacked": True, "plain": False, "hf": None}[w] for w in args.weights.split(",")):
                if prepack is None and tp > 1:
                    continue  # the hf engine runs one worker
                label = f"engine TP{tp}, " + ("hf engine (in place)" if prepack is None else
                                              "prepacked weights" if prepack else "plain weights (in place)")
                ecfg = cfg.model_copy(update={"tensor_model_parallel_size": tp, "cpu_prepack_weights": bool(prepack),
                                              "name": "hf" if prepack is None else "vllm"})
                out, port = ctx.SimpleQueue(), free_port()
                procs = [ctx.Process(target=trainer_rank, args=(r, tp, port, str(path), ecfg, args.repeats, cores,
                                                                prompts.tolist(), out)) for r in range(tp)]
                for proc in procs:
                    proc.start()
                for proc in procs:
                    proc.join()
                if any(proc.exitcode for proc in procs) or out.empty():
                    raise SystemExit(f"{label}: a trainer rank failed (exit codes {[p.exitcode for p in procs]})")
                runs, rate = out.get()
                m = min((r[0] for r in runs), key=lambda r: r["weight_sync/seconds"])
                s_, fl = m["weight_sync/seconds"], min(r[1] for r in runs)
                paired = sorted(r[0]["weight_sync/seconds"] / r[1] for r in runs)
                sync_ratio[label] = s_ / fl
                sync_seconds[label] = s_
                print(f"weight sync, {label}, {tp} trainer rank(s) each writing its engine worker's shard: "
                      f"{nbytes / 2**20:.0f} MiB in {int(m['weight_sync/num_buckets'])} buckets of <= {args.bucket_mb} "
                      f"MiB: {s_:.3f}s ({nbytes / s_ / 1e9:.2f} GB/s; rank 0 writing "
                      f"{m['weight_sync/exchange_seconds']:.3f}s, the engine loading "
                      f"{m['weight_sync/engine_load_seconds']:.3f}s, in place {bool(m['weight_sync/in_place'])}, "
                      f"written straight into the engine's parameters "
                      f"{m['weight_sync/placed_bytes'] / m['weight_sync/bytes']:.0%}); "
                      f"in-memory copy floor {fl:.3f}s ({nbytes / fl / 1e9:.2f} GB/s); ratio sync/floor = "
                      f"{s_ / fl:.1f}x (best of {args.repeats} each; median of the paired ratios "
                      f"{paired[len(paired) // 2]:.1f}x); decoding {rate:.0f} tok/s; load average "
                      f"{os.getloadavg()[0]:.1f}", flush=True)
        if sync_ratio:
            print("sync/floor ratios: " + ", ".join(f"{k} {v:.1f}x" for k, v in sync_ratio.items()), flush=True)
        hf_key, vllm_key = "engine TP1, hf engine (in place)", "engine TP1, plain weights (in place)"
        if hf_key in sync_seconds and vllm_key in sync_seconds:
            print(f"weight sync hf engine / vLLM (plain weights), same model, this run: "
                  f"{sync_seconds[hf_key]:.3f}s / {sync_seconds[vllm_key]:.3f}s = "
                  f"{sync_seconds[hf_key] / sync_seconds[vllm_key]:.2f}x", flush=True)
        if args.sync_only:
            return 0

        # -- 2. rollout tokens/s vs HF generate ----------------------------------------------------------------------
        from transformers import AutoModelForCausalLM

        plan = apply_engine_threads(available_cores())
        cfg = cfg.model_copy(update={"dtype": args.dtype})
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
        engine = VLLMEngine(cfg, str(path), seed=0, device="cpu")
        print(f"vLLM engine start (in this process): {engine.start_seconds:.1f}s", flush=True)
        engine.generate(prompts[:1].tolist(), n=1)  # warm-up
        contenders = (("vllm", plan.threads), ("hf", plan.threads), ("vllm_1_thread", 1), ("hf_1_thread", 1))
        best = {name: float("inf") for name, _ in contenders}
        for _ in range(args.gen_repeats):
            for name, threads in contenders:
                SET_THREADS(threads)
                t0 = time.perf_counter()
                if name.startswith("hf"):
                    with torch.no_grad():
                        out = hf.generate(prompts, attention_mask=torch.ones_like(prompts),
                                          max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                          do_sample=args.samples > 1, num_return_sequences=args.samples,
                                          temperature=1.0, top_k=0, top_p=1.0, pad_token_id=1)
                    tokens = (out.shape[1] - args.prompt_len) * out.shape[0]
                else:
                    batch = engine.generate(prompts.tolist(), n=args.samples)
                    tokens = int(batch.response_lengths.sum())
                best[name] = min(best[name], time.perf_counter() - t0)
                assert tokens == seqs * args.new_tokens, (name, tokens)
        SET_THREADS(plan.threads)
        same = sum(out[i, args.prompt_len:].tolist() == batch.response(i) for i in range(args.prompts)) \
            if args.samples == 1 else None
        rate = {k: seqs * args.new_tokens / v for k, v in best.items()}
        sampled = f"{args.samples} samples each at temperature 1" if args.samples > 1 else "greedy"
        print(f"rollout ({args.dtype}): {args.prompts} prompts x {args.prompt_len} tokens -> {args.new_tokens} new "
              f"tokens ({sampled}), "
              f"best of {args.gen_repeats}; engine threads {plan.threads} on cores {plan.omp_bind}: "
              f"vLLM {rate['vllm']:.0f} tok/s ({best['vllm']:.2f}s), HF generate {rate['hf']:.0f} tok/s "
              f"({best['hf']:.2f}s), ratio vLLM/HF = {rate['vllm'] / rate['hf']:.2f}x; at 1 thread each: vLLM "
              f"{rate['vllm_1_thread']:.0f} tok/s, HF {rate['hf_1_thread']:.0f} tok/s, ratio "
              f"{rate['vllm_1_thread'] / rate['hf_1_thread']:.2f}x; vLLM with the plan vs vLLM at 1 thread "
              f"{rate['vllm'] / rate['vllm_1_thread']:.2f}x; "
              + (f"identical greedy outputs {same}/{args.prompts}; " if same is not None else "")
              + f"load average {os.getloadavg()[0]:.1f}", flush=True)
        engine.shutdown()

        # -- 3. engine replicas, as the trainer runs them (engine child processes) -----------------------------------
        from concurrent.futures import ThreadPoolExecutor

        shares = [cores] if len(cores) < 2 else [cores[: len(cores) // 2], cores[len(cores) // 2:]]
        rates = {}
        for label, groups in (("1 replica", [cores]), (f"{len(shares)} replicas", shares)):
            engines = [EngineProcess(cfg, str(path), cores=c) for c in groups]
            parts = [prompts[i::len(engines)].tolist() for i in range(len(engines))]
            for e, part in zip(engines, parts):
                e.generate(part[:1], n=1)  # warm-up
            with ThreadPoolExecutor(len(engines)) as pool:
                t0 = time.perf_counter()
                done = list(pool.map(lambda ep: ep[0].generate(ep[1], n=args.samples), zip(engines, parts)))
                seconds = time.perf_counter() - t0
            rates[label] = sum(int(b.response_lengths.sum()) for b in done) / seconds
            for e in engines:
                e.shutdown()
        print("rollout through engine processes: " + ", ".join(f"{k} {v:.0f} tok/s" for k, v in rates.items())
              + f" on {len(cores)} cores", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
