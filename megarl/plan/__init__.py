"""`megarl plan`: will a recipe fit on a cluster? Per-GPU memory of every term, weight-sync bytes and time, a verdict.

Pure arithmetic on the recipe and the model's config.json (no GPU, no weights), in the steps plan_recipe (planner.py) takes:
the model and where it runs (model.py), memory per role (memory.py), the engine (engine.py), the sync, the time and
the phases (phases.py), the text (text.py). Each module's docstring holds its part of the memory model.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

from megarl.plan.memory import in_flight_layers
from megarl.plan.model import Cluster, PlanError
from megarl.plan.planner import (DEFAULT_GPU_MEM_GIB, DEFAULT_HOST_MEM_GIB, DEFAULT_LINK_GBPS, PlanReport,
                                 plan_recipe, plan_steps)
from megarl.plan.timing import DEFAULT_GPU, GPUS

__all__ = ["PlanError", "PlanReport", "add_arguments", "in_flight_layers", "main", "plan_recipe", "plan_steps",
           "response_lengths", "run"]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="megarl plan", description="Per-GPU memory, weight-sync bytes and time for a "
                                 "recipe on a cluster, and a verdict (exit 1 when it does not fit); --search for the "
                                 "best layout; --measure for each phase's measured peak beside the planned one.")
    add_arguments(ap)
    return run(ap.parse_intermixed_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("recipe", help="recipe YAML")
    ap.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as parallelism.tensor_model_"
                    "parallel_size=8")
    ap.add_argument("--nodes", type=int, help="nodes in the cluster (required but with --measure)")
    ap.add_argument("--gpus-per-node", type=int, help="GPUs per node (required but with --measure)")
    ap.add_argument("--gpu", choices=sorted(GPUS), help="the GPU kind: its memory, dense bf16 FLOP/s, HBM and NVLink "
                    "bandwidth (vendor datasheets, megarl/plan/timing.py) for the plan and the search's time model "
                    "(default H100)")
    ap.add_argument("--gpu-mem", type=float, default=None, help="GiB per GPU, overriding --gpu's (default: --gpu's, "
                    "else 80)")
    ap.add_argument("--host-mem", type=float, default=DEFAULT_HOST_MEM_GIB, help="GiB of host memory per node "
                    "(default 2048)")
    ap.add_argument("--search", action="store_true", help="search the layouts (TP, PP, CP, VPP, EP, expert TP, "
                    "micro-batch, recompute, offload, distributed optimizer, engine TP/EP, replicas, placement) that "
                    "validate accepts and fit, ranked by planned step time")
    ap.add_argument("--top", type=int, default=5, help="--search: how many layouts to print, fastest first, each "
                    "with its step time's margin over the one above and over #1 (default 5)")
    ap.add_argument("--margin", type=float, default=0.10, help="--search: share of each GPU left free (default 0.10: "
                    "the plan's terms are within 10%% of measured peaks on CPU, and on GPU it was 8%% low before "
                    "they were added)")
    ap.add_argument("--write", metavar="RECIPE_OUT", help="--search: write the best layout into a copy of the recipe")
    ap.add_argument("--measure", action="store_true", help="run a few real trainer steps of the recipe at its own "
                    "layout (trainer.nnodes x n_gpus_per_node ranks, CPU or GPU) on a copy of its model cut to "
                    "--layers and print each phase's measured peak beside the planned one")
    ap.add_argument("--layers", type=int, default=2, help="--measure: layers of the measured copy (default 2; "
                    "rounded to the pipeline size)")
    ap.add_argument("--steps", type=int, default=2, help="--measure: steps to run (default 2; the peaks are the "
                    "largest over the steps, the seconds the last step's)")
    ap.add_argument("--long-tail", type=float, default=0.0, metavar="TAIL", help="--measure: responses of "
                    "lognormal lengths, the longest rollout.response_length and TAIL x the median (e.g. 16), and the "
                    "plan given that batch's mean and longest (default: every response at full length)")
    ap.add_argument("--calibration-out", metavar="FILE", help="--measure: write the measured peaks, seconds and "
                    "achieved TFLOP/s per phase as JSON")
    ap.add_argument("--calibration", metavar="FILE", help="--search: rank by the forward and update TFLOP/s "
                    "measured by --measure --calibration-out instead of the assumed MFU")
    ap.add_argument("--response-lengths", metavar="RUN_DIR", help="count micro-batches from a run's measured "
                    "responses (RUN_DIR or its metrics.jsonl: the largest train/response_length_mean and "
                    "train/response_length_max), rows packed, instead of every row at full length")
    ap.add_argument("--mean-response-tokens", type=float, help="with --max-response-tokens: the measured mean "
                    "response, in tokens (instead of --response-lengths)")
    ap.add_argument("--max-response-tokens", type=int, help="with --mean-response-tokens: the longest response")
    ap.add_argument("--link-gbps", type=float, default=DEFAULT_LINK_GBPS, help="link bandwidth for the weight-sync "
                    "bound, GB/s (default 50: one 400 Gb/s NIC)")


def run(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError
    from megarl.validate import load_config

    overrides = list(args.overrides)
    misplaced = [(flag, needs) for flag, given, needs in (
        ("--calibration-out", getattr(args, "calibration_out", None), "measure"),
        ("--long-tail", getattr(args, "long_tail", None), "measure"),
        ("--calibration", getattr(args, "calibration", None), "search")) if given and not getattr(args, needs, False)]
    if misplaced:
        print(f"megarl plan: {misplaced[0][0]} is an option of --{misplaced[0][1]}; add that flag or leave it out",
              file=sys.stderr)
        return 2
    if getattr(args, "measure", False):
        if args.search:
            print("megarl plan: --measure and --search are two commands: measure the recipe's own layout first "
                  "(--calibration-out FILE), then search with --calibration FILE", file=sys.stderr)
            return 2
        if any(getattr(args, k, None) is not None for k in ("response_lengths", "mean_response_tokens",
                                                            "max_response_tokens")):
            print("megarl plan: --measure plans its own batch's lengths (full length, or --long-tail TAIL); "
                  "--response-lengths and --mean/--max-response-tokens are for the plan of a cluster",
                  file=sys.stderr)
            return 2
        return run_measure(args, overrides)
    gpu = GPUS[args.gpu] if getattr(args, "gpu", None) else DEFAULT_GPU
    if getattr(args, "gpu_mem", None) is None:
        args.gpu_mem = gpu.mem_gib if getattr(args, "gpu", None) else DEFAULT_GPU_MEM_GIB
    args.gpu_kind = gpu
    if args.nodes is None or args.gpus_per_node is None:
        print("megarl plan: --nodes and --gpus-per-node are required (the cluster to plan for); --measure runs the "
              "recipe's own layout instead", file=sys.stderr)
        return 2
    try:
        probe = load_config(args.recipe, overrides)
        if probe.engine_placement == "colocated":  # the trainer takes the whole cluster; else engines add GPUs
            overrides += [f"trainer.nnodes={args.nodes}", f"trainer.n_gpus_per_node={args.gpus_per_node}"]
        cfg = load_config(args.recipe, overrides)
        lengths = response_lengths(args, cfg.rollout.response_length)
        if getattr(args, "search", False):
            if lengths is not None:
                print("megarl plan: --response-lengths and --mean/--max-response-tokens size the plan of the "
                      "recipe's own layout; --search counts every row at full length", file=sys.stderr)
                return 2
            return run_search(args, cfg, overrides)
        report = plan_recipe(cfg, args.nodes, args.gpus_per_node, args.gpu_mem, args.link_gbps, args.host_mem,
                             lengths=lengths)
    except (ConfigError, PlanError) as exc:
        print(f"megarl plan: {exc}", file=sys.stderr)
        return 1
    print(f"# {args.recipe}")
    print(report.text)
    return 0 if report.fits else 1


def response_lengths(args: argparse.Namespace, response_length: int):
    """The measured Lengths the options give (None: none given, the worst case); PlanError for a half or a double
    answer."""
    from megarl.plan.memory import Lengths, check_lengths, read_lengths

    path = getattr(args, "response_lengths", None)
    mean, longest = getattr(args, "mean_response_tokens", None), getattr(args, "max_response_tokens", None)
    if path and (mean is not None or longest is not None):
        raise PlanError("--response-lengths reads the lengths from a run; --mean/--max-response-tokens give them: "
                        "use one or the other")
    if (mean is None) != (longest is None):
        raise PlanError("--mean-response-tokens and --max-response-tokens go together (the mean sizes the packed "
                        "rows, the longest the micro-batch that holds it)")
    lengths = read_lengths(path) if path else Lengths(mean, longest, "given") if mean is not None else None
    if lengths is not None:
        check_lengths(lengths, response_length)
    return lengths


def run_measure(args: argparse.Namespace, overrides: list) -> int:
    from megarl.plan.measure import run_measure as measure

    if args.layers < 1 or args.steps < 1:
        print(f"megarl plan --measure: --layers {args.layers} --steps {args.steps}: both must be at least 1",
              file=sys.stderr)
        return 2
    tail = getattr(args, "long_tail", 0.0) or 0.0
    if tail and tail < 1:
        print(f"megarl plan --measure: --long-tail {tail:g}: the longest response is TAIL x the median, so TAIL is "
              "at least 1 (16 for a long tail)", file=sys.stderr)
        return 2
    return measure(args.recipe, overrides, args.layers, args.steps, args.calibration_out, timeout_s=1800, tail=tail)


def run_search(args: argparse.Namespace, cfg, overrides: list) -> int:
    from megarl.plan.search import render as render_search
    from megarl.plan.search import search, write_recipe

    from megarl.plan.timing import read_calibration

    calibration = None
    if getattr(args, "calibration", None):
        try:
            calibration = read_calibration(args.calibration)
        except ValueError as exc:
            print(f"megarl plan: {exc}", file=sys.stderr)
            return 2
    gpu = getattr(args, "gpu_kind", DEFAULT_GPU)
    res = search(cfg, args.nodes, args.gpus_per_node, args.gpu_mem, args.link_gbps, args.host_mem, args.top,
                 args.margin, calibration=calibration, gpu=gpu)
    line = (f"megarl plan --search: {args.nodes} node(s) x {args.gpus_per_node} {gpu.name} GPU(s) of "
            f"{args.gpu_mem:g} GiB, margin {args.margin:.0%}")
    print(f"# {args.recipe}")
    print(render_search(res, line, Cluster(args.nodes, args.gpus_per_node, args.gpu_mem, args.link_gbps).gpu_bytes))
    if args.write and res.best:
        given = dict(o.split("=", 1) for o in overrides if "=" in o)
        write_recipe(args.recipe, {**_typed(given), **res.best[0].settings}, args.write)
        print(f"wrote {args.write}: the recipe with layout #1")
    return 0 if res.best else 1


def _typed(values: dict) -> dict:
    import yaml

    return {k: yaml.safe_load(v) for k, v in values.items()}
