"""Time per step of trainer.mode sync vs one_step_off_policy vs async on the tiny GRPO recipe, in one run.

Every mode runs as a user runs it (`megarl train`, SFT warm-started model, same prompts and seeds) with the engine and
the trainer on separate cores (rollout.engine_cpu_cores: the engine takes the last cores of the machine, the trainer's
rank the others), so that in the modes that overlap them each side computes on its own cores, and sync pays the same
split. A step's wall time is the gap between consecutive rows of metrics.jsonl. Per step:

    engine busy   rollout/generate_seconds   the engine generating the batch the step trains on
    trainer idle  timing/rollout_s           the trainer waiting for that batch (and for a weight sync due then)
    trainer busy  wall - trainer idle        rewards, logprob passes, the update, the sync, logging
    engine idle   wall - engine busy
    overlap       (engine busy + trainer busy - wall) / min(engine busy, trainer busy): the share of the shorter
                  side hidden behind the longer one (0: one after the other, as sync; 1: fully hidden)

Sync runs first and last (half of its timed steps each), so a change of load on a shared machine affects it like
the others; ratios are against it.

    .venv/bin/python bench/bench_async.py                                  # 150 SFT steps once, then 16 steps per mode
    .venv/bin/python bench/bench_async.py --steps 10 --work-dir /tmp/bench_async   # reuse a previous SFT model
    .venv/bin/python bench/bench_async.py --set rollout.response_length=128 rollout.ignore_eos=true  # longer rollouts
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_step import (RECIPE, megarl_cmd, prepare_sft_model, shared_overrides,  # noqa: E402
                        train_watching_steps)

MODES = {"sync": [], "one_step_off_policy": [],
         "async": ["async_training.max_staleness=2"]}


def run_mode(work: Path, mode: str, steps: int, warmup: int, engine_cores: int, tag: str, extra=()) -> list[dict]:
    """`megarl train` in `mode` for warmup + steps steps; per timed step its wall time and the phase split."""
    run_dir = work / f"run_{tag}_{int(time.time())}"
    cmd = megarl_cmd("train", str(RECIPE), f"trainer.run_dir={run_dir}", *shared_overrides(work),
                     f"trainer.total_steps={warmup + steps + 1}", "trainer.test_freq=0",
                     "trainer.val_before_train=false", "logging.tensorboard=false", f"trainer.mode={mode}",
                     f"rollout.engine_cpu_cores={engine_cores}", "algorithm.rollout_correction.is_level=token",
                     *MODES[mode], *extra)
    rows, seen = train_watching_steps(cmd, run_dir / "metrics.jsonl", work / f"{tag}.log", f" ({mode})")
    out = []
    # the last step also writes the final checkpoint: left out, like the warm-up
    for a, b, row in zip(seen[warmup:], seen[warmup + 1:-1], rows[warmup + 1:-1]):
        wall = b - a
        engine = row["rollout/generate_seconds"]
        waited = row["timing/rollout_s"]
        out.append({"wall": wall, "engine_busy": engine, "engine_idle": max(0.0, wall - engine),
                    "trainer_busy": wall - waited, "trainer_idle": waited,
                    "staleness": row.get("async/staleness_mean", 0.0)})
    return out


def summary(steps: list[dict]) -> dict:
    s = {k: median(x[k] for x in steps) for k in steps[0]}
    s["staleness"] = sum(x["staleness"] for x in steps) / len(steps)
    shorter = min(s["engine_busy"], s["trainer_busy"])
    s["overlap"] = max(0.0, s["engine_busy"] + s["trainer_busy"] - s["wall"]) / shorter if shorter > 0 else 0.0
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=16, help="timed steps per mode (sync: half before, half after)")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first in each run")
    ap.add_argument("--engine-cores", type=int, help="cores the engine takes (default: half of this machine's)")
    ap.add_argument("--work-dir", help="keeps the data and SFT model between runs (default: a temporary folder)")
    ap.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                    help="recipe overrides for every mode, e.g. rollout.response_length=128 rollout.ignore_eos=true "
                         "(a task whose rollout is a larger share of the step)")
    args = ap.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="megarl-bench-async-"))
    work.mkdir(parents=True, exist_ok=True)
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("bench_async needs at least 2 cores (one for the engine, one for the trainer)")
        return 1
    engine_cores = args.engine_cores or len(cores) // 2
    prepare_sft_model(work)

    half = max(1, args.steps // 2)
    plan = [("sync", half, "sync_a"), ("one_step_off_policy", args.steps, "one_step"), ("async", args.steps, "async"),
            ("sync", args.steps - half, "sync_b")]
    results: dict[str, list] = {}
    for mode, n, tag in plan:
        if n <= 0:
            continue
        print(f"bench: {mode}, {n} timed steps ...", flush=True)
        results.setdefault(mode, []).extend(run_mode(work, mode, n, args.warmup, engine_cores, tag, args.set))

    table = {mode: summary(steps) for mode, steps in results.items()}
    base = table["sync"]["wall"]
    print(f"\nseconds per GRPO step on the tiny recipe, medians of {args.steps} steps per mode; engine on "
          f"{engine_cores} of {len(cores)} cores, trainer on the other {len(cores) - engine_cores}"
          + (f"; with {' '.join(args.set)}" if args.set else "") + ":")
    head = ("mode", "step", "vs sync", "engine busy", "engine idle", "trainer busy", "trainer idle", "overlap",
            "staleness")
    print(f"{head[0]:<21}" + "".join(f"{h:>13}" for h in head[1:]))
    for mode, s in table.items():
        print(f"{mode:<21}{s['wall']:>13.3f}{s['wall'] / base:>13.2f}{s['engine_busy']:>13.3f}{s['engine_idle']:>13.3f}"
              f"{s['trainer_busy']:>13.3f}{s['trainer_idle']:>13.3f}{s['overlap']:>13.2f}{s['staleness']:>13.2f}")
    print("overlap: share of the shorter side hidden behind the longer one (0: serial, 1: fully hidden); "
          "staleness: mean weight versions between the sampling weights and the trained actor")
    return 0


if __name__ == "__main__":
    sys.exit(main())
