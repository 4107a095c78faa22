"""`megarl convert-verl`: the command line over the conversion (its arguments, the report on stderr, the recipe on
stdout or --out, and the exit status)."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import yaml

from megarl.convert_verl.convert import convert
from megarl.convert_verl.inputs import gather
from megarl.convert_verl.record import report_lines, to_recipe_text

DESCRIPTION = ("Turn a verl Hydra config (YAML) or a verl command line (key=value overrides, or a .sh script that "
               "runs verl.trainer.main_ppo) into a megarl recipe. Prints every key it mapped and refuses, by name, "
               "each it cannot; the recipe goes to stdout or --out.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("inputs", nargs="+", metavar="CONFIG_OR_OVERRIDE",
                        help="verl config YAML, a shell script running verl, and/or overrides such as "
                        "actor_rollout_ref.rollout.n=8 (later ones win)")
    parser.add_argument("--out", "-o", default=None, help="write the recipe here instead of stdout")
    parser.add_argument("--strict", action="store_true", help="exit 1 when any key was refused or the recipe "
                        "trains something different from verl (the DIFFERS lines)")
    parser.add_argument("--config-path", "-cp", default=None, help="verl's --config-path: the directory of the "
                        "--config-name file (a script's own flags are read from the script)")
    parser.add_argument("--config-name", "-cn", default=None, help="verl's --config-name: a config file whose "
                        "settings (and Hydra defaults) are read under the overrides; verl's ppo_trainer / "
                        "ppo_megatron_trainer select that trainer's defaults")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="a shell variable for the script (as if exported before running it); repeatable")


def run(args: argparse.Namespace) -> int:
    try:
        inputs = gather(args.inputs, _environ(args.env), args.config_path, args.config_name)
    except (ValueError, OSError, yaml.YAMLError) as exc:
        print(f"megarl convert-verl: {exc}", file=sys.stderr)
        return 1
    c = convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer, from_files=inputs.file_keys)
    c.notes = inputs.notes + c.notes
    text = to_recipe_text(c, args.inputs)
    print(f"verl trainer: {inputs.trainer} (its defaults that differ from megarl's apply under the settings given)",
          file=sys.stderr)
    for line in report_lines(c):
        print(line, file=sys.stderr)
    if args.out:
        Path(args.out).write_text(text)
        print(f"recipe: {args.out} (check it with `megarl validate {args.out}`)", file=sys.stderr)
    else:
        print(text, end="")
    return 1 if (args.strict and (c.refused or c.differs)) else 0


def _environ(items: list[str]) -> dict:
    """The process environment with each --env NAME=VALUE over it (the script's shell variables)."""
    environ = dict(os.environ)
    for item in items:
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--env {item!r}: expected NAME=VALUE")
        environ[name] = value
    return environ
