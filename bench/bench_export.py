"""Export throughput: a >=100M-parameter Llama-like megatron model at TP=2 -> HF-named full tensors (GB/s), next to a
plain in-memory copy (torch clone) of the same bytes in the same run.

    .venv/bin/python bench/bench_export.py [--hidden 768 --layers 12 --vocab 32000 --bucket-mb 256 --tp 2 --repeat 2]

Two local ranks (megarl.launch_local, gloo on CPU / NCCL on GPU). The model is randomly initialised from an ArchSpec
(no checkpoint on disk is needed); `export_hf_weights` streams every tensor to every rank (dst_rank=None) and, in a
second pass, to rank 0 only (dst_rank=0, the merger's mode). GB/s counts the bytes of the HF tensors delivered.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def spec_dict(hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // 64
    return dict(architectures=["LlamaForCausalLM"], hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 3) if heads % 3 == 0 else heads,
                intermediate_size=hidden * 8 // 3 // 64 * 64, vocab_size=vocab, max_position_embeddings=2048,
                rms_norm_eps=1e-5, tie_word_embeddings=False)


def bench_rank(cfg: dict, tp: int, bucket_bytes: int, repeat: int) -> dict:
    import torch.distributed as dist

    from megarl.bridge import export_hf_weights, spec_from_dict
    from megarl.bridge.mapping import num_parameters
    from megarl.megatron.model import build_gpt_model
    from megarl.megatron.parallel import Layout, init_model_parallel

    init_model_parallel(Layout(tensor_model_parallel_size=tp), seed=0)
    spec = spec_from_dict(cfg)
    t0 = time.perf_counter()
    model = build_gpt_model(spec)
    build_s = time.perf_counter() - t0
    results = {"params": num_parameters(spec), "build_s": build_s}
    for mode, dst in (("all_ranks", None), ("to_rank0", 0)):
        best, copy_best = float("inf"), float("inf")
        for _ in range(repeat):  # export and copy alternate, so a burst of load from elsewhere hits both alike
            kept = []
            dist.barrier()
            t0 = time.perf_counter()
            nbytes, nbuckets = 0, 0
            for bucket in export_hf_weights(model, spec, bucket_bytes=bucket_bytes, dst_rank=dst):
                nbuckets += 1
                for _, tensor in bucket:
                    nbytes += tensor.numel() * tensor.element_size()
                    kept.append(tensor)
            dist.barrier()
            best = min(best, time.perf_counter() - t0)
            if kept:  # the same tensors, copied in memory: the ceiling of any export
                t0 = time.perf_counter()
                copies = [t.clone() for t in kept]
                copy_best = min(copy_best, time.perf_counter() - t0)
                del copies
        results[mode] = {"seconds": best, "bytes": nbytes, "buckets": nbuckets, "copy_seconds": copy_best}
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--bucket-mb", type=float, default=256)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args(argv)

    from megarl.bridge import spec_from_dict
    from megarl.bridge.mapping import num_parameters
    from megarl.launch_local import run_ranks

    cfg = spec_dict(args.hidden, args.layers, args.vocab)
    params = num_parameters(spec_from_dict(cfg))
    print(f"Llama-like model: hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}: {params / 1e6:.1f}M "
          f"parameters ({params * 4 / 1e9:.2f} GB fp32) at TP={args.tp}, buckets of {args.bucket_mb:g} MB")
    t0 = time.perf_counter()
    res = run_ranks("bench.bench_export:bench_rank", args.tp,
                    {"cfg": cfg, "tp": args.tp, "bucket_bytes": int(args.bucket_mb * (1 << 20)),
                     "repeat": args.repeat}, timeout=1800,
                    env={"PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(
                        os.path.abspath(__file__))), os.environ.get("PYTHONPATH")]))})
    r0 = res[0]
    print(f"model build {r0['build_s']:.1f}s; total wall (incl. rank start-up) {time.perf_counter() - t0:.1f}s")
    print(f"{'mode':<28} {'GB':>6} {'buckets':>8} {'export s':>9} {'export GB/s':>12} {'copy GB/s':>10} {'ratio':>6}")
    for mode, label in (("all_ranks", "export -> every rank"), ("to_rank0", "export -> rank 0 (merger)")):
        m = r0[mode]
        gb = m["bytes"] / 1e9
        export_gbs = gb / m["seconds"]
        copy_gbs = gb / m["copy_seconds"]
        print(f"{label:<28} {gb:>6.2f} {m['buckets']:>8} {m['seconds']:>9.2f} {export_gbs:>12.2f} {copy_gbs:>10.2f} "
              f"{export_gbs / copy_gbs:>6.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
