"""megarl.checkpoint.locate and the pure parts of megarl.checkpoint.state: discovery of complete checkpoints, leftovers, keep-last-k, resume."""
import json
from types import SimpleNamespace

import pytest

from megarl.checkpoint.locate import (checkpoints_dir, checkpoints_to_delete, complete_checkpoints, is_complete,
                                      latest_checkpoint, resolve_resume, stale_entries)
from megarl.checkpoint.state import rollout_seed


def _ckpt(root, name, step=None, complete=True, meta=True):
    path = root / name
    (path / "actor").mkdir(parents=True)
    if meta:
        (path / "meta.json").write_text(json.dumps({"step": step, "complete": complete}))
    return path


@pytest.fixture
def run_dir(tmp_path):
    root = checkpoints_dir(tmp_path)
    _ckpt(root, "step_2", 2)
    _ckpt(root, "step_10", 10)
    _ckpt(root, "step_4", 4)
    _ckpt(root, "step_12.tmp", 12)  # a save a crash interrupted after meta.json, before the rename
    _ckpt(root, "step_11", meta=False)  # no meta.json: never finished
    _ckpt(root, "step_13", 13, complete=False)
    _ckpt(root, "step_14", 7)  # meta.json of another step: not trusted
    (root / "step_15").mkdir()
    (root / "step_15" / "meta.json").write_text("{not json")
    _ckpt(root, "step_3.old.tmp", 3)
    (root / "notes.txt").write_text("a user's file")
    return tmp_path


def test_discovery_sees_only_complete_step_directories(run_dir):
    root = checkpoints_dir(run_dir)
    assert [s for s, _ in complete_checkpoints(root)] == [2, 4, 10]  # numeric order, not 10 < 2
    assert latest_checkpoint(root) == root / "step_10"
    assert not is_complete(root / "step_12.tmp") and not is_complete(root / "step_11")


def test_stale_entries_are_the_leftovers_of_crashes_and_nothing_else(run_dir):
    root = checkpoints_dir(run_dir)
    assert [p.name for p in stale_entries(root)] == ["step_11", "step_12.tmp", "step_13", "step_14", "step_15",
                                                     "step_3.old.tmp"]


def test_keep_last_k(run_dir):
    root = checkpoints_dir(run_dir)
    assert [p.name for p in checkpoints_to_delete(root, 2)] == ["step_2"]
    assert [p.name for p in checkpoints_to_delete(root, 1)] == ["step_2", "step_4"]
    assert checkpoints_to_delete(root, 3) == [] and checkpoints_to_delete(root, None) == []


def test_empty_or_missing_directories(tmp_path):
    assert complete_checkpoints(tmp_path / "none") == [] and latest_checkpoint(tmp_path / "none") is None
    assert stale_entries(tmp_path / "none") == [] and checkpoints_to_delete(tmp_path / "none", 1) == []
    assert resolve_resume("auto", tmp_path) is None  # a fresh run


def test_resolve_resume(run_dir):
    root = checkpoints_dir(run_dir)
    assert resolve_resume("disable", run_dir) is None
    assert resolve_resume("auto", run_dir) == root / "step_10"
    assert resolve_resume(str(root / "step_4"), "/elsewhere") == root / "step_4"
    assert resolve_resume(str(run_dir), "/elsewhere") == root / "step_10"  # a run directory: its latest
    assert resolve_resume(str(root), "/elsewhere") == root / "step_10"
    with pytest.raises(ValueError, match="incomplete save"):
        resolve_resume(str(root / "step_12.tmp"), run_dir)
    with pytest.raises(ValueError, match="does not exist"):
        resolve_resume(str(run_dir / "nope"), run_dir)


def test_rollout_seed_is_per_step_and_fixed_by_the_config():
    cfg = SimpleNamespace(rollout=SimpleNamespace(seed=None), trainer=SimpleNamespace(seed=1))
    seeds = [rollout_seed(cfg, s) for s in range(1, 200)]
    assert len(set(seeds)) == len(seeds) and all(0 <= s < 2 ** 31 for s in seeds)
    assert min(abs(a - b) for a, b in zip(seeds, seeds[1:])) > 10_000  # a batch's prompt seeds (seed + i*n) never meet
    engine_seeded = SimpleNamespace(rollout=SimpleNamespace(seed=0), trainer=SimpleNamespace(seed=1))
    assert rollout_seed(engine_seeded, 1) != seeds[0]  # rollout.seed (0 included) takes precedence
