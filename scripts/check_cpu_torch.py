"""Refuse a CUDA build of torch in the CPU environment, before `make env` installs anything.

    python scripts/check_cpu_torch.py -c constraints-cpu.txt torch==2.13.0

Run by the interpreter of the environment being built (standard library only: nothing else is installed yet). Two
checks, each ending in one line that says what to do:
  - a torch already installed here (an earlier `make env` that pulled the CUDA build) is a CUDA build: pip would keep
    it, since it satisfies torch==2.13.0 too, so only a fresh environment (`make clean-env`) gets rid of it;
  - pip, asked what it would install for the pinned torch (a dry run: nothing is installed, though pip downloads a
    wheel to read its requirements where the index serves no separate metadata), would install a CUDA build (a `+cu`
    version, or nvidia-* packages beside it): the CPU wheels are not reachable.
Exit 0 when neither holds, 1 otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from importlib import metadata

FIX = ("make the CPU build of torch reachable: set PIP_EXTRA_INDEX_URL to the PyTorch CPU wheel index, or "
       "PIP_FIND_LINKS to a folder holding the torch +cpu wheel")


def cuda_markers(name: str, version: str, requires: list[str]) -> list[str]:
    """What makes a torch distribution a CUDA build: a +cu local version, nvidia-* requirements."""
    found = [f"{name} {version}"] if "+cu" in version else []
    return found + sorted({re.match(r"[A-Za-z0-9._-]+", r).group() for r in requires
                           if r.lower().startswith("nvidia-")})


def installed_torch_problem() -> str | None:
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return None
    found = cuda_markers("torch", dist.version, list(dist.requires or []))
    if not found:
        return None
    return (f"error: this environment already holds a CUDA build of torch ({dist.version}, needs {found[-1]}) from an "
            f"earlier install; run `make clean-env`, then {FIX}, then `make env`")


def planned_install(pip_args: list[str], env: dict | None = None) -> list[dict]:
    """pip's dry-run report of what `pip install PIP_ARGS` would install here, ignoring what is installed: the
    `install` items (metadata: name, version, requires_dist)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                              "--report", report, *pip_args], capture_output=True, text=True, env=env)
        if out.returncode != 0:
            raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else "pip failed")
        with open(report) as f:
            return json.load(f)["install"]


def planned_torch_problem(items: list[dict]) -> str | None:
    found = []
    for item in items:
        meta = item["metadata"]
        if meta["name"].lower() == "torch":
            found += cuda_markers("torch", meta["version"], meta.get("requires_dist") or [])
        elif meta["name"].lower().startswith("nvidia-"):
            found.append(meta["name"])
    if not found:
        return None
    torch = next((i["metadata"]["version"] for i in items if i["metadata"]["name"].lower() == "torch"), "?")
    return (f"error: pip would install a CUDA build of torch {torch} (with {', '.join(sorted(set(found))[:3])}): "
            f"{FIX}, then run `make env` again")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-c", "--constraint", help="pip constraints file")
    ap.add_argument("requirement", nargs="+", help="what make env installs first, e.g. torch==2.13.0")
    args = ap.parse_args(argv)
    problem = installed_torch_problem()
    if problem is None:
        pip_args = (["-c", args.constraint] if args.constraint else []) + args.requirement
        try:
            problem = planned_torch_problem(planned_install(pip_args))
        except RuntimeError as exc:
            problem = f"error: pip cannot find {' '.join(args.requirement)} ({exc}): {FIX}"
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
