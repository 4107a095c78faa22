"""Convert verl launch scripts with `megarl convert-verl` and tabulate the outcome (the table in docs/recipes.md).

    python tools/verl_convert_table.py VERL_CHECKOUT/examples/grpo_trainer/*megatron*.sh ... [--env NAME=VALUE]

For each script: keys mapped / dropped / refused, whether `megarl validate` accepts the recipe, the refused keys, and
any traceback or `$` left in the recipe. Runs nothing from the scripts.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

import yaml

from megarl.config import ConfigError
from megarl.convert_verl import convert, gather
from megarl.validate import load_config


def one(script: str, environ: dict) -> dict:
    row = {"script": script, "error": None}
    try:
        inputs = gather([script], environ)
        c = convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer,
                    from_files=inputs.file_keys)
    except ValueError as exc:  # a script the converter refuses to read (an error message, not a traceback)
        row["error"] = str(exc).splitlines()[0]
        return row
    except Exception:
        row["error"] = "TRACEBACK " + traceback.format_exc().splitlines()[-1]
        return row
    text = yaml.safe_dump(c.recipe)
    row.update(mapped=len(c.mapped), dropped=len(c.dropped), refused=[r.split(" = ")[0] for r in c.refused],
               refused_lines=c.refused, dollar="$" in text, trainer=inputs.trainer)
    try:
        load_config(data=c.recipe)
        row["valid"] = True
    except ConfigError as exc:
        row["valid"] = False
        row["validate"] = [i.render() for i in exc.issues]
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("scripts", nargs="+")
    parser.add_argument("--env", action="append", default=[])
    parser.add_argument("--details", action="store_true", help="print every refusal")
    args = parser.parse_args()
    environ = dict(os.environ)
    environ.update(item.split("=", 1) for item in args.env)
    print("| script | trainer | mapped | dropped | refused | validate | refused keys |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = [one(s, environ) for s in args.scripts]
    for r in rows:
        name = "/".join(Path(r["script"]).parts[-2:])
        if r["error"]:
            print(f"| {name} | | | | | | {r['error']} |")
            continue
        keys = ", ".join(k.replace("actor_rollout_ref.", "").replace("override_transformer_config.", "otc.")
                         for k in dict.fromkeys(r["refused"]))
        print(f"| {name} | {r['trainer']} | {r['mapped']} | {r['dropped']} | {len(r['refused'])} | "
              f"{'accepts' if r['valid'] else 'REFUSES'} | {keys}{' ($ LEFT)' if r['dollar'] else ''} |")
    if args.details:
        for r in rows:
            for line in r.get("refused_lines", []) + r.get("validate", []):
                print(f"{Path(r['script']).name}: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
