#!/usr/bin/env python
"""Run one recipe once per seed, each in a fresh directory, one run at a time, then report the runs side by side:
validation reward at the first and last evaluation, the best, the gain, and the range of gains over the seeds.

    python tools/seed_range.py recipes/grpo_tiny_cpu.yaml        # seeds 1 2 3 in runs/seeds/grpo_tiny_cpu/s1, s2, s3
    python tools/seed_range.py recipes/grpo_tiny_cpu.yaml --seeds 1 2 3 4 5 --min-gain 0.15
    python tools/seed_range.py recipes/dapo_tiny_cpu.yaml \\
        model.path=runs/seeds/grpo_tiny_cpu/s{seed}/init_model sft.output_dir=runs/seeds/grpo_tiny_cpu/s{seed}/sft_model

A learning figure from one seed is one sample; the per-recipe ranges in docs/results.md are runs of this kind. Every
run gets trainer.seed=S and trainer.run_dir=RUN_ROOT/sS. What a run makes for itself moves into its own directory, so
no seed starts from another seed's files: the model that model.create_tiny creates (model.path), the SFT model
(sft.output_dir, when sft.enable) and the generated data (data.synthetic.output_dir). An override given here wins over
that, and `{seed}` in an override becomes the run's seed (to start each seed from that seed's run of another recipe,
as above). Existing run directories are refused before anything starts; a run that fails stops the sweep (the runs
before it are kept and reported), and so does Ctrl-C or SIGTERM: the running seed stops as `megarl train` does on
them (a checkpoint at the end of its step), and no later seed starts. Exit code: 0, or 1 when a run failed or a gain
is below --min-gain, 2 for bad arguments, 130 when interrupted.
"""
from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from megarl import cli  # noqa: E402
from megarl.config import ConfigError, parse_config  # noqa: E402
from megarl.validate import load_config  # noqa: E402


def seed_overrides(recipe: str, seed: int, run_dir: Path, overrides: Sequence[str]) -> list[str]:
    """The overrides of one seed's run: trainer.seed and trainer.run_dir, the paths the run creates moved into
    run_dir (where the recipe creates them and `overrides` does not set them), then `overrides` with {seed} filled in.
    Raises ConfigError for a recipe that cannot be read (load_config checks the rest)."""
    mine = [o.replace("{seed}", str(seed)) for o in overrides]
    cfg, _ = parse_config(recipe, mine)
    if cfg is None:  # the schema refused the recipe as a whole: load_config below says why
        return [f"trainer.seed={seed}", f"trainer.run_dir={run_dir}"] + mine
    given = {o.split("=", 1)[0].strip() for o in mine}  # the key as megarl.config's apply_overrides reads it
    moved = {}
    if cfg.model.create_tiny is not None:
        moved["model.path"] = run_dir / "init_model"
    if cfg.sft.enable:
        moved["sft.output_dir"] = run_dir / "sft_model"
    if cfg.data.synthetic is not None:
        moved["data.synthetic.output_dir"] = run_dir / "data"
    return ([f"trainer.seed={seed}", f"trainer.run_dir={run_dir}"]
            + [f"{k}={v}" for k, v in moved.items() if k not in given] + mine)


def _run_to_its_end(command: list[str]) -> tuple[int, int | None]:
    """Run `command` and wait for it however it ends: (its exit code, the SIGINT or SIGTERM this process got meanwhile,
    else None). Ctrl-C in a terminal and a scheduler's SIGTERM reach the whole process group, so the run has the signal
    too and stops on its own, saving a checkpoint first; killing it here instead (what subprocess.run does on
    KeyboardInterrupt) would lose that."""
    got: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: got.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = subprocess.run(command).returncode
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return code, (got[0] if got else None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="seed_range.py", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("recipe", help="the recipe YAML")
    parser.add_argument("overrides", nargs="*", help="section.key=value overrides for every run; {seed} is replaced "
                                                     "by the run's seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3], help="the seeds (default: 1 2 3)")
    parser.add_argument("--run-root", default=None,
                        help="the folder of the runs, one sS per seed (default: runs/seeds/<recipe name>)")
    parser.add_argument("--min-gain", type=float, default=None, metavar="G",
                        help="exit 1 when a run's validation reward gains less than G (passed to megarl report)")
    args = parser.parse_intermixed_args(argv)

    if len(set(args.seeds)) != len(args.seeds):
        parser.error(f"--seeds {' '.join(map(str, args.seeds))}: each seed once")
    root = Path(args.run_root or Path("runs") / "seeds" / Path(args.recipe).stem)
    dirs = [root / f"s{s}" for s in args.seeds]
    taken = [str(d) for d in dirs if d.exists() and any(d.iterdir())]
    if taken:
        print(f"seed_range: {', '.join(taken)} already exist: each seed runs in a fresh directory (a run there would "
              f"resume or reuse its files). Remove them or pass another --run-root.", file=sys.stderr)
        return 2
    try:  # every seed's config checked as `megarl validate` would, before the first run starts
        plans = [seed_overrides(args.recipe, s, d, args.overrides) for s, d in zip(args.seeds, dirs)]
        for plan in plans:
            load_config(args.recipe, plan)
    except ConfigError as exc:
        print(f"seed_range: {exc}", file=sys.stderr)
        return 2

    done = []
    for i, (seed, run_dir, overrides) in enumerate(zip(args.seeds, dirs, plans), start=1):
        command = [sys.executable, "-m", "megarl", "train", args.recipe, *overrides]
        print(f"== seed {seed} ({i} of {len(dirs)}): megarl train {args.recipe} {' '.join(overrides)}", flush=True)
        code, signum = _run_to_its_end(command)
        if signum is not None:
            print(f"seed_range: {signal.Signals(signum).name} during seed {seed}: its run stopped as `megarl train` "
                  f"does (a checkpoint at the end of its step; exit code {code}) and {run_dir} holds it, a partial "
                  f"run; the {len(dirs) - i} seed(s) after it were not run", file=sys.stderr)
            return 130
        if code != 0:
            logs = f"; its logs are in {run_dir / 'logs'}" if (run_dir / "logs").is_dir() else ""
            print(f"seed_range: seed {seed} failed (exit code {code}{logs}); the {len(dirs) - i} seed(s) after it "
                  f"were not run", file=sys.stderr)
            if done:
                cli.main(["report", *map(str, done)])
            return 1
        done.append(run_dir)
    report = ["report", *map(str, done)] + (["--min-gain", str(args.min_gain)] if args.min_gain is not None else [])
    return cli.main(report)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # before a run started or during the report: nothing to save
        print("seed_range: interrupted", file=sys.stderr)
        sys.exit(130)
