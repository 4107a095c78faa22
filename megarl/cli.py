"""`megarl` command line: validate | verify (more subcommands arrive as their features land)."""
from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def _cmd_validate(args: argparse.Namespace) -> int:
    from megarl.config import ConfigError, load_config, to_yaml

    try:
        cfg = load_config(args.recipe, args.overrides)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 1
    for warning in cfg._warnings:
        print(f"warning: {warning.render()}", file=sys.stderr)
    print(to_yaml(cfg), end="")
    print(f"# {args.recipe}: valid", file=sys.stderr)
    return 0


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
    sub.add_parser("verify", add_help=False, help="load an HF model at a Megatron layout and compare logprobs with "
                   "HF transformers (see `megarl verify --help`)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "verify":  # verify owns its own argument parser
        return _cmd_verify(argparse.Namespace(), argv[1:])
    if not argv:
        parser.print_help()
        return 2
    args = parser.parse_args(argv)  # an unknown command prints usage and exits 2
    return {"validate": _cmd_validate}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
