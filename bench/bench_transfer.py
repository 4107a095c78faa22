"""Weight sync into an engine placed separately vs a colocated one, one run, side-by-side ratios.

Two trainer ranks (data parallel: both hold the whole model) and one vLLM engine process started by rank 0. The same
engine receives the same weights both ways, alternately:
  colocated  rank 0 hosts the engine's worker: it copies its own pieces into the bucket files, rank 1 sends it
             nothing (rank 0 holds everything): megarl.sync.transports.colocated
  separate   the engine process is a member of the transfer group: both ranks send it their half of the pieces over
             gloo, it writes them into the bucket files: megarl.sync.transports.remote
against the floor: copying the same bytes into preallocated buffers in one process. The best of --repeats each.

    .venv/bin/python bench/bench_transfer.py                     # ~60M params, fp32 (a few minutes on 2 cores)
    .venv/bin/python bench/bench_transfer.py --hidden 256 --layers 2 --vocab 4096   # a quick smoke run
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def measure(hf_dir: str, repeats: int, bucket_mb: int) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.config.schema import RolloutConfig
    from megarl.megatron.model import build_and_load
    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.sync.factory import SyncFactory
    from megarl.rollout.hosting.process import EngineProcess
    from megarl.layout import EngineTopology

    init_model_parallel(Layout(), seed=0)
    model, spec = build_and_load(hf_dir)
    engine = None
    if dist.get_rank() == 0:
        cfg = RolloutConfig(prompt_length=16, response_length=16, dtype="float32", kv_cache_memory_bytes=64 << 20,
                            max_num_seqs=4, load_format="dummy")
        engine = EngineProcess(cfg, hf_dir, seed=0)
    factory = SyncFactory(model, spec)  # both transports over one mapping and holdings
    colocated = factory.colocated(engine, EngineTopology(dist.get_world_size(), 1, 1), bucket_mb << 20)
    separate = factory.remote(engine, bucket_mb << 20)
    best = {"colocated": float("inf"), "separate": float("inf")}
    last = {}
    for _ in range(repeats):
        for name, sync in (("colocated", colocated), ("separate", separate)):
            dist.barrier()
            m = sync.run(engine)
            best[name] = min(best[name], m["weight_sync/seconds"])
            last[name] = m
    out = {"best": best, "metrics": last}
    if engine is not None:
        nbytes = int(last["separate"]["weight_sync/bytes"])
        src = [p.detach().clone() for p in model.parameters()]
        dst = [torch.empty_like(p) for p in src]
        floor = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            for d, s in zip(dst, src):
                d.copy_(s)
            floor = min(floor, time.perf_counter() - t0)
        out.update(floor=floor * nbytes / sum(s.numel() * s.element_size() for s in src), bytes=nbytes)
        engine.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--ffn", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--bucket-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    from bench_rollout import make_model
    from megarl.launch_local import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        nparams = make_model(Path(tmp), args.hidden, args.layers, args.ffn, args.vocab, args.heads)
        print(f"model: Llama {nparams / 1e6:.1f}M params (fp32); 2 trainer ranks (data parallel), 1 engine", flush=True)
        results = run_ranks("bench_transfer:measure", 2, {"hf_dir": tmp, "repeats": args.repeats,
                                                          "bucket_mb": args.bucket_mb}, timeout=1800,
                            env={"PYTHONPATH": os.pathsep.join(sys.path[:2] + [os.environ.get("PYTHONPATH", "")])})
    r = results[0]
    co, sep, floor = r["best"]["colocated"], r["best"]["separate"], r["floor"]
    m = r["metrics"]["separate"]
    print(f"weight sync of {r['bytes'] / 2**20:.0f} MiB in {args.bucket_mb} MiB buckets, best of {args.repeats}: "
          f"colocated {co:.3f}s, separate (transfer group) {sep:.3f}s, in-memory copy floor {floor:.3f}s; "
          f"ratios separate/colocated = {sep / co:.2f}x, colocated/floor = {co / floor:.1f}x, "
          f"separate/floor = {sep / floor:.1f}x")
    print(f"separate: rank 0 sent {m['weight_sync/sent_bytes_rank0']:,.0f} B, the busiest rank "
          f"{m['weight_sync/sent_bytes_max']:,.0f} B (plan {m['weight_sync/plan_sent_bytes_max']:,.0f}); the engine "
          f"host received {m['weight_sync/received_bytes_max']:,.0f} B (plan "
          f"{m['weight_sync/plan_received_bytes_max']:,.0f}); load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
