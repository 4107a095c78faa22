"""Delta vs full weight updates into an engine placed apart from the trainer (rollout.placement=separate), in one run.

`megarl train recipes/grpo_separate_tiny_cpu.yaml` runs twice back to back for the same steps, from the same SFT
model: once with rollout.delta_updates=true (the recipe's), once with false (every update whole). Per update it reads
from metrics.jsonl what the engine host received (`weight_sync/received_bytes_max`), the update's wall time
(`weight_sync/seconds`), whether it was a full one, the pieces sent in each format (megarl.sync.delta), the trainer
ranks' resident memory and the bytes of their kept copies, how many pieces the trainer's and the host's checksums
agreed on and how many engine tensors the workers read back (a mismatch stops the run). Printed: bytes and seconds
per update for both, and delta / full.

`--memory` measures instead, in this process, what keeping the last-sent copy costs a trainer rank on CPU: fp32
"parameters" of --memory-mib MiB cut into pieces, sent in bfloat16 through the sync's own DeltaSender (the first
update whole, then updates changing ~1% of the elements): the resident memory before the first update, after it and
after the others, against the bytes of one bfloat16 copy.

In bfloat16 (the recipe's engine dtype) most elements of an update round to what the engine holds; in float32 nearly
every element changes (`--dtype float32` shows it; delta updates are off by default there).

    .venv/bin/python bench/bench_delta.py                    # 20 steps each, bfloat16 engine
    .venv/bin/python bench/bench_delta.py --lr 1e-6
    .venv/bin/python bench/bench_delta.py --memory
    .venv/bin/python bench/bench_rollout.py --delta          # the same
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "grpo_separate_tiny_cpu.yaml"


def run(work: Path, name: str, steps: int, dtype: str, delta: bool, lr: float | None, extra=()) -> list[dict]:
    """One `megarl train` of the recipe (the tiny model and its SFT warm start made once, in work/base); its metrics
    rows."""
    run_dir = work / name
    args = [f"trainer.run_dir={run_dir}", f"trainer.total_steps={steps}", "trainer.test_freq=0",
            "trainer.val_before_train=false", f"rollout.dtype={dtype}", f"rollout.delta_updates={str(delta).lower()}",
            *([f"actor.optim.lr={lr}"] if lr else []), *extra,
            f"model.path={work / 'base' / 'init_model'}", f"sft.output_dir={work / 'base' / 'sft_model'}",
            f"data.synthetic.output_dir={work / 'base' / 'data'}"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    print(f"== {name}: megarl train {RECIPE.name} {' '.join(args[1:7])}", flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    console = run_dir / "console.log"
    with open(console, "w") as out:
        code = subprocess.run([sys.executable, "-m", "megarl", "train", str(RECIPE), *args], cwd=ROOT, env=env,
                              stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        sys.exit(f"{name}: megarl train exited {code}; the end of its console ({console}):\n"
                 + "\n".join(console.read_text(errors="replace").splitlines()[-15:]))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def updates(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "weight_sync/received_bytes_max" in r]


KINDS = ("same", "dense", "indices", "mask", "runs")


def summary(rows: list[dict]) -> dict:
    ups = updates(rows)
    later = ups[1:] or ups  # the first update is whole in both modes
    return {"updates": len(ups), "bytes": mean(r["weight_sync/received_bytes_max"] for r in later),
            "seconds": mean(r["weight_sync/seconds"] for r in later),
            "full": sum(int(r.get("weight_sync/full_update", 1)) for r in ups),
            "changed": [r["weight_sync/changed_elements"] for r in ups if r.get("weight_sync/full_update") == 0],
            "checked": [int(r.get("weight_sync/checked_pieces", 0)) for r in ups],
            "read_back": [int(r.get("weight_sync/verified_tensors", 0)) for r in ups],
            "kinds": {k: sum(r.get(f"weight_sync/pieces_{k}", 0) for r in ups
                             if r.get("weight_sync/full_update") == 0) for k in KINDS},
            "rss": [r.get("weight_sync/trainer_rss_bytes_max", 0) / 2 ** 20 for r in ups],
            "kept": max((r.get("weight_sync/delta_kept_bytes_max", 0) for r in ups), default=0) / 2 ** 20}


def rss_mib() -> float:
    """Resident MiB of this process, after handing freed heap back to the system (glibc keeps freed transients of the
    updates otherwise, which are no copy of anything)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def memory(mib: int, updates: int = 5) -> None:
    """RSS of this process around the DeltaSender's kept copy (megarl.sync.transports.remote_delta), on CPU."""
    import torch

    sys.path.insert(0, str(ROOT))  # this tree's megarl, as the runs' PYTHONPATH gives it
    from megarl.sync.transports.remote_delta import DeltaSender, DeltaSettings

    torch.manual_seed(0)
    numel = mib * 2 ** 20 // 4
    params = [torch.randn(numel // 64) for _ in range(64)]  # fp32, as a CPU trainer holds them
    sender = DeltaSender(DeltaSettings(), [1], ["w"])
    gen = torch.Generator().manual_seed(1)

    def update(u: int) -> float:
        full = sender.full_hosts()
        sent = 0
        for i, p in enumerate(params):
            if u:
                p[torch.rand(p.shape, generator=gen) < 0.01] += 0.01
            piece = p.to(torch.bfloat16)  # the wire dtype, a transient of one piece as in RemoteSync._piece
            _, tensors = sender.encode((0, i), piece, 1 in full)
            sent += sum(t.numel() * t.element_size() for t in tensors)
        return sent / 2 ** 20

    before = rss_mib()
    first = update(0)
    after_first = rss_mib()
    later = [update(u) for u in range(1, updates + 1)]
    after = rss_mib()
    kept = sum(t.numel() * t.element_size() for t in sender.kept.values()) / 2 ** 20
    print(f"fp32 parameters {mib} MiB in 64 pieces, sent in bfloat16; one bfloat16 copy = {kept:.1f} MiB")
    print(f"RSS before the first update {before:.1f} MiB, after it {after_first:.1f} MiB (+{after_first - before:.1f}), "
          f"after {updates} more {after:.1f} MiB (+{after - after_first:.1f})")
    print(f"sent: first {first:.1f} MiB, then {min(later):.2f}-{max(later):.2f} MiB per update")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"), help="the engine's dtype")
    ap.add_argument("--lr", type=float, default=None, help="the actor's learning rate (default: the recipe's 5e-4, "
                    "far above an LLM's ~1e-6, so that a tiny model learns in 150 steps; at 1e-6 the share of bf16 "
                    "elements an update changes is an LLM's)")
    ap.add_argument("--work-dir", default=None, help="keep the runs here (default: a temporary directory); the SFT "
                    "model in WORK/base is made once and reused")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a recipe override for both "
                    "runs (e.g. rollout.delta_verify_sample=0 to see what the engine's read-back costs)")
    ap.add_argument("--memory", action="store_true", help="instead: the kept copy's resident memory, in this process")
    ap.add_argument("--memory-mib", type=int, default=512, help="--memory: MiB of fp32 parameters (default 512)")
    args = ap.parse_args(argv)
    if args.memory:
        memory(args.memory_mib)
        return
    tag = f"-lr{args.lr:g}" if args.lr else ""
    with tempfile.TemporaryDirectory(prefix="megarl-bench-delta-") as tmp:
        work = Path(args.work_dir or tmp)
        delta = summary(run(work, f"delta-{args.dtype}{tag}", args.steps, args.dtype, True, args.lr, args.set))
        full = summary(run(work, f"full-{args.dtype}{tag}", args.steps, args.dtype, False, args.lr, args.set))
    elements = full["bytes"] / (2 if args.dtype == "bfloat16" else 4)
    print(f"\n{args.steps} steps each, {args.dtype} engine, actor lr {args.lr or 'of the recipe'}; updates after the "
          f"first (whole in both modes):")
    print(f"{'':8}{'updates':>8}{'full ones':>10}{'bytes/update':>14}{'s/update':>10}")
    for name, s in (("delta", delta), ("full", full)):
        print(f"{name:8}{s['updates']:>8}{s['full']:>10}{s['bytes']:>14,.0f}{s['seconds']:>10.4f}")
    print(f"delta / full: bytes {delta['bytes'] / full['bytes']:.3f}, time {delta['seconds'] / full['seconds']:.3f}")
    if delta["changed"]:
        share = [c / elements for c in delta["changed"]]
        print(f"elements changed per delta update: {min(share):.1%} to {max(share):.1%} of the model")
    print("pieces of the delta updates by format: " + ", ".join(f"{k} {v:.0f}" for k, v in delta["kinds"].items()))
    checked, read = delta["checked"], delta["read_back"]
    print(f"checksums: {sum(1 for c in checked if c)} of {len(checked)} updates checked "
          f"({min(checked)}-{max(checked)} pieces each), all equal (a mismatch stops the run); engine tensors read "
          f"back from the workers' memory per update: {min(read)}-{max(read)}")
    print(f"trainer rank resident memory (max over ranks), MiB: delta {min(delta['rss']):.0f}-{max(delta['rss']):.0f},"
          f" full {min(full['rss']):.0f}-{max(full['rss']):.0f}; kept copies of the delta run {delta['kept']:.2f} MiB "
          "a rank")


if __name__ == "__main__":
    main()
