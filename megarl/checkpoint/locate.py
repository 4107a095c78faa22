"""Where a run's checkpoints live, which are complete, which to delete and what to resume from: pure path logic over
the layout that megarl.checkpoint.state writes (<run_dir>/checkpoints/step_<N>/ with a meta.json saying complete). No
process group, no torch: validation, the merger and the importer read checkpoints through this module.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

LAYOUT_VERSION = "megarl-checkpoint-v1"
META_FILE = "meta.json"
TRAINER_STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_STALE = re.compile(r"^step_\d+(\..+)?\.tmp$")  # step_N.tmp (a save in progress) and step_N.old.tmp (replaced)

def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step_{step}"


def read_meta(path: str | Path) -> Optional[dict]:
    """The checkpoint's meta.json, or None when missing or unreadable."""
    try:
        return json.loads((Path(path) / META_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(path: str | Path) -> bool:
    """A finished checkpoint: a `step_<N>` directory whose meta.json says complete and names the same step."""
    path = Path(path)
    m = _STEP_DIR.match(path.name)
    meta = read_meta(path) if m and path.is_dir() else None
    return bool(meta and meta.get("complete") is True and meta.get("step") == int(m.group(1)))


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every complete checkpoint under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return sorted(found)


def latest_checkpoint(root: str | Path) -> Optional[Path]:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def stale_entries(root: str | Path) -> list[Path]:
    """What a crash may leave: `step_<N>.tmp` directories and `step_<N>` directories without a complete meta.json."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir()
                  if _STALE.match(p.name) or (_STEP_DIR.match(p.name) and not is_complete(p)))


def checkpoints_to_delete(root: str | Path, keep_last_k: Optional[int]) -> list[Path]:
    """The complete checkpoints beyond the newest `keep_last_k` (None keeps all)."""
    found = complete_checkpoints(root)
    if keep_last_k is None or len(found) <= keep_last_k:
        return []
    return [p for _, p in found[:len(found) - keep_last_k]]


def resolve_resume(resume: str, run_dir: str | Path) -> Optional[Path]:
    """Which checkpoint to resume from for `checkpoint.resume`.

    "disable": None. "auto": the latest complete checkpoint of run_dir, None if there is none. A path: a complete
    `step_<N>` directory, or a run directory / checkpoints directory (its latest complete checkpoint)."""
    if resume == "disable":
        return None
    if resume == "auto":
        return latest_checkpoint(checkpoints_dir(run_dir))
    path = Path(resume)
    if is_complete(path):
        return path
    for root in (path, checkpoints_dir(path)):
        latest = latest_checkpoint(root)
        if latest is not None:
            return latest
    why = ("it does not exist" if not path.exists() else
           "it is an incomplete save (no meta.json with complete=true: the run stopped while writing it)"
           if _STEP_DIR.match(path.name) or path.name.endswith(".tmp") else "it holds no complete step_<N> checkpoint")
    raise ValueError(f"checkpoint.resume={resume!r} cannot be resumed from: {why}; pass a complete "
                     f"<run_dir>/checkpoints/step_<N> directory, `auto` (latest in trainer.run_dir) or `disable`")
