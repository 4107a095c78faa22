"""Inputs that megarl's own commands and tools write at a fixed place, so a recipe that reads them can say what to
run first when they are missing (the shipped real-model recipes read both kinds).

The model names are those `megarl get-model` knows (megarl.get_model.KNOWN holds how to fetch each; a test keeps
the two lists equal); the data commands are those of tools/data/ with the options the Makefile's `demo-real` uses.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

GET_MODEL_NAMES = ("smollm2-135m-instruct",)
WORD_PROBLEMS_DIR = Path("data") / "word_problems"
WORD_PROBLEMS_COMMAND = ("python tools/data/word_problems.py --out-dir data/word_problems --num-train 2000 "
                         "--num-val 64 --steps 1 --max-number 10 --seed 0")


def get_model_out(name: str) -> Path:
    """Where `megarl get-model NAME` writes by default (relative to the working directory)."""
    return Path("models") / name


def absolute(path) -> Path:
    """`path` with ~ expanded, made absolute (not resolving links): how inputs and outputs of recipes are compared."""
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def maker_of(path: str) -> Optional[str]:
    """The command that writes `path` at its default place ("`megarl get-model smollm2-135m-instruct`"), or None."""
    target = absolute(path)
    for name in GET_MODEL_NAMES:
        if target == absolute(get_model_out(name)):
            return f"`megarl get-model {name}`"
    if target.parent == absolute(WORD_PROBLEMS_DIR) and target.stem in ("train", "val", "val_unseen"):
        return f"`{WORD_PROBLEMS_COMMAND}`"
    return None
