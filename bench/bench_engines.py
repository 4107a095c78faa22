"""Seconds per RL step with each rollout engine, one run, side by side: `megarl train RECIPE rollout.name=vllm`
against `rollout.name=hf` (the transformers engine), from the same SFT model and seed, no validation.

Both engines sample the same number of responses of the same length limits; the step's other phases (rewards,
log-probs, the update, the weight sync) are the trainer's and the same code for both. The runs alternate (vllm, hf,
vllm, hf, ...) so that load from other processes hits both alike, and each run's first --warmup steps are left out
(engine start-up, first compilations). Printed: the median seconds per step and per phase of each engine, and the
ratio hf / vllm.

    .venv/bin/python bench/bench_engines.py                          # the demo recipe, 20 steps, 2 rounds
    .venv/bin/python bench/bench_engines.py --steps 10 --rounds 1    # quicker
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("step", "rollout", "train", "sync")


def run(recipe: str, engine: str, workdir: Path, steps: int, seed: int, overrides: list) -> list[dict]:
    """One `megarl train` of `steps` steps with `engine`; its metrics rows. The tiny model and the SFT model are made
    once in `workdir` and reused by every later run (the same weights for both engines)."""
    run_dir = workdir / f"run-{engine}-{len(list(workdir.glob('run-*')))}"
    args = [sys.executable, "-m", "megarl", "train", recipe, f"rollout.name={engine}", f"trainer.seed={seed}",
            f"trainer.total_steps={steps}", "trainer.test_freq=0", "trainer.val_before_train=false",
            "checkpoint.save_freq=0", "logging.tensorboard=false", f"trainer.run_dir={run_dir}",
            f"model.path={workdir / 'init_model'}", f"sft.output_dir={workdir / 'sft_model'}",
            f"data.synthetic.output_dir={workdir / 'data'}", *overrides]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"bench_engines: the {engine} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def medians(rows: list[dict], warmup: int) -> dict:
    kept = [r for r in rows if r["step"] > warmup]
    return {p: statistics.median(r[f"timing/{p}_s"] for r in kept) for p in PHASES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="recipes/grpo_tiny_cpu.yaml")
    ap.add_argument("--steps", type=int, default=20, help="RL steps per run")
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out of the medians")
    ap.add_argument("--rounds", type=int, default=2, help="vllm, hf pairs (alternating)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("overrides", nargs="*", help="section.key=value for both engines")
    args = ap.parse_args()
    if args.steps <= args.warmup:
        ap.error(f"--steps {args.steps} must be above --warmup {args.warmup}")
    with tempfile.TemporaryDirectory(prefix="megarl-bench-engines-") as tmp:
        work = Path(tmp)
        runs = {"vllm": [], "hf": []}
        for r in range(args.rounds):
            for engine in runs:
                runs[engine].append(medians(run(args.recipe, engine, work, args.steps, args.seed, args.overrides),
                                            args.warmup))
                print(f"round {r + 1} {engine}: " + ", ".join(f"{p} {v:.3f} s" for p, v in runs[engine][-1].items()),
                      flush=True)
    best = {e: {p: min(m[p] for m in ms) for p in PHASES} for e, ms in runs.items()}
    print(f"\n{args.recipe}, {args.steps} steps a run ({args.warmup} left out), best of {args.rounds} alternating "
          f"rounds, median seconds per step:")
    print(f"{'phase':<10}{'vllm':>10}{'hf':>10}{'hf / vllm':>12}")
    for p in PHASES:
        v, h = best["vllm"][p], best["hf"][p]
        print(f"{p:<10}{v:>10.3f}{h:>10.3f}{(h / v if v > 0 else float('nan')):>12.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
