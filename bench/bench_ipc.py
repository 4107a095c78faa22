"""The colocated GPU weight sync (pulled writes over CUDA IPC, megarl.sync.pull) against a device memcpy of the same
bytes, one run, side-by-side ratio; and which memcpy kinds the sync used (PCIe: HtoD/DtoH bytes, expected 0).

One trainer rank (Megatron TP1, the model built on the GPU with random weights) and a stand-in engine worker in its own process on the same GPU,
holding parameters in the layout a real vLLM worker reported for the same model (tests.helpers.standin; the layout of a
1.1B Llama in bfloat16 is recorded in tests/fixtures/engine_layout). Figures: the best of --repeats each.
  sync     the trainer's whole weight sync (handles, the worker's copies, the update opened and closed)
  write    of which the worker's loads: opening the trainer's handles and copying every piece into its parameters
  floor    one device copy of the same number of bytes (torch's copy_ between two preallocated buffers)
The last line says whether the pull (write) is within 1.5x the floor.

    python bench/bench_ipc.py                                  # on a GPU: the 1.1B layout, bfloat16
    python bench/bench_ipc.py --device cpu --layout tests/fixtures/engine_layout/llama_tiny_tp1.json   # smoke, CPU
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_LAYOUT = ROOT / "tests" / "fixtures" / "engine_layout" / "llama_1b_bf16_tp1.json"
PULL_TARGET = 1.5  # the worker's copies of every piece against one device memcpy of all the bytes


def build_on_device(record: dict):
    """The recorded model's megatron actor with random weights (their values do not matter here), created where it
    computes: on a GPU its parameters are allocated there, with no HF checkpoint built and saved on the CPU first."""
    import torch

    from megarl.bridge import spec_from_dict
    from megarl.megatron.model import build_gpt_model

    spec = spec_from_dict({k: v for k, v in record["config"].items() if k != "transformers_version"})
    model = build_gpt_model(spec, dtype=getattr(torch, record["dtype"]))
    if torch.cuda.is_available():
        model.cuda()  # megatron allocated the weights on the device already; this moves any buffer it kept on the CPU
    return model, spec


def measure(record: dict, device: str, repeats: int, bucket_mb: int) -> dict:
    import torch
    import torch.distributed as dist

    from megarl.megatron.parallel import Layout, init_model_parallel
    from megarl.layout import EngineTopology
    from megarl.sync.factory import build_sync
    from tests.helpers.standin import StandInEngine, memcpy_bytes

    init_model_parallel(Layout(), seed=0)
    model, spec = build_on_device(record)
    engine = StandInEngine(record, device=device)
    cuda = device == "cuda"

    def wait():
        if cuda:
            torch.cuda.synchronize()

    try:
        sync = build_sync(model, spec, engine, EngineTopology(dist.get_world_size(), 1, 1), bucket_mb << 20)
        first = sync.run(engine)
        nbytes = int(first["weight_sync/placed_bytes"])
        times, writes = [], []
        engine.take_load_seconds()
        for _ in range(repeats):
            wait()
            t0 = time.perf_counter()
            sync.run(engine)
            times.append(time.perf_counter() - t0)
            writes.append(engine.take_load_seconds())
        src = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        floor = []
        for _ in range(repeats + 1):
            wait()
            t0 = time.perf_counter()
            dst.copy_(src)
            wait()
            floor.append(time.perf_counter() - t0)
        kinds = {}
        if cuda:
            engine.profile_loads(True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                sync.run(engine)
            kinds = {"worker": engine.profile_loads(False), "trainer": memcpy_bytes(prof)}
        return {"bytes": nbytes, "sync": min(times), "write": min(writes), "floor": min(floor[1:]), "buckets": len(sync.buckets),
                "kinds": kinds, "gpu": torch.cuda.get_device_name() if cuda else "cpu"}
    finally:
        engine.shutdown()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", default=str(DEFAULT_LAYOUT), help="a recorded worker layout (JSON)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=4096, help="rollout.update_weights_bucket_megabytes")
    args = ap.parse_args()
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_ipc: no CUDA GPU here; use --device cpu for the smoke run", file=sys.stderr)
        return 2
    from megarl.launch_local import run_ranks

    record = json.loads(Path(args.layout).read_text())
    r = run_ranks("bench_ipc:measure", 1, {"record": record, "device": args.device, "repeats": args.repeats,
                                            "bucket_mb": args.bucket_mb},
                  env={"PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT),
                                                      os.environ.get("PYTHONPATH", "")])})[0]
    gib = r["bytes"] / 2**30
    print(f"device: {r['gpu']}; layout: {Path(args.layout).name} ({record['dtype']}, vLLM {record['vllm']} worker), "
          f"{gib:.2f} GiB per sync in {r['buckets']} bucket(s)")
    print(f"{'':<8}{'seconds':>10}{'GB/s':>8}{'x floor':>9}")
    for name in ("sync", "write", "floor"):
        print(f"{name:<8}{r[name]:>10.4f}{r['bytes'] / r[name] / 1e9:>8.1f}{r[name] / r['floor']:>9.2f}")
    for side, kinds in r["kinds"].items():
        print(f"memcpy during one sync, {side}: " + (", ".join(f"{k}: {v} B" for k, v in sorted(kinds.items()))
                                                      or "none"))
    if r["kinds"]:
        pcie = sum(b for kinds in r["kinds"].values() for k, b in kinds.items() if "HtoD" in k or "DtoH" in k)
        print(f"bytes over PCIe per sync: {pcie}")
    pull = r["write"] / r["floor"]
    print(f"target: the IPC pull within {PULL_TARGET:g}x a device memcpy of the same bytes: "
          f"{'MET' if pull <= PULL_TARGET else 'SHORT'} (pull {pull:.2f}x, whole sync {r['sync'] / r['floor']:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
