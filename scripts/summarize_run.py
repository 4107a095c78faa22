"""Print what a run achieved from its metrics.jsonl: validation reward before and after RL, and where time went.

Usage: python scripts/summarize_run.py RUN_DIR
"""
import json
import sys
from pathlib import Path
from statistics import fmean


def main(run_dir: str) -> int:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        print(f"no metrics at {path}", file=sys.stderr)
        return 1
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    val = [(r["step"], r["val/reward_mean"]) for r in rows if r.get("val/reward_mean") is not None]
    steps = [r for r in rows if r["step"] > 0]
    print(f"run: {run_dir}  ({len(steps)} RL steps)")
    if val:
        (s0, v0), (s1, v1) = val[0], val[-1]
        print(f"validation reward: {v0:.3f} at step {s0} -> {v1:.3f} at step {s1} (gain {v1 - v0:+.3f})")
        print("validation curve: " + ", ".join(f"{s}:{v:.3f}" for s, v in val))
    if steps:
        first, last = steps[: max(1, len(steps) // 10)], steps[-max(1, len(steps) // 10):]
        print(f"train reward: first 10% of steps {fmean(r['train/reward_mean'] for r in first):.3f}, "
              f"last 10% {fmean(r['train/reward_mean'] for r in last):.3f}")
        phases = ["rollout", "reward", "old_log_prob", "ref", "values", "train", "sync"]
        parts = {p: fmean(r.get(f"timing/{p}_s", 0.0) for r in steps) for p in phases}
        total = fmean(r["timing/step_s"] for r in steps)
        shown = ", ".join(f"{p} {v:.3f}" for p, v in parts.items() if v > 0)
        print(f"time per step: {total:.3f} s = {shown} (s, means over steps)")
        print(f"rollout/trainer logprob gap: step 1 {steps[0]['rollout/logprob_abs_diff_mean']:.2e}, "
              f"max over steps {max(r['rollout/logprob_abs_diff_mean'] for r in steps):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/grpo_tiny_cpu"))
