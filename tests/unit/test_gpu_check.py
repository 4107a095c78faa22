"""`make gpu-check` (scripts/gpu_check.sh) on a machine without a usable CUDA Python stops in one line with a non-zero
exit before writing anything; its wheels folder installs Transformer Engine only together with TE's core library."""
import os
import subprocess
import sys
from pathlib import Path

from tests.unit.test_gpu_target import _wheel

ROOT = Path(__file__).resolve().parents[2]


def _check(tmp_path, *args, **env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_PYTHON", "GPU_VENV", "WHEELS", "OUT")}
    env.update(OUT=str(tmp_path / "out"), **env_extra)
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def test_without_cuda_the_check_refuses_in_one_line_and_writes_nothing(tmp_path):
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("this machine has a CUDA GPU: the check would run")
    r = _check(tmp_path, GPU_PYTHON=sys.executable)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1, r.stderr
    assert lines[0].startswith("error: megarl's GPU checks (make test-gpu, gpu-check) need a CUDA GPU"), lines
    assert "CPU build" in lines[0] and r.stdout == ""
    assert not (tmp_path / "out").exists()  # no output folder, no summary: nothing ran


def test_an_unknown_argument_is_refused_in_one_line(tmp_path):
    r = _check(tmp_path, "--fast", GPU_PYTHON=sys.executable)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "error: gpu_check.sh: unknown argument '--fast'; give --full for the long form, nothing for the quick one"]


def _install(tmp_path, names):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for name in names:
        _wheel(wheels, name, name)
    site = tmp_path / "site"
    cmd = (f". scripts/gpu_env.sh; GPU_PY={sys.executable}; GPU_SITE={site}; WHEELS={wheels}; _gpu_wheels && "
           'echo "NOTE=$GPU_WHEELS_NOTE"')
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    installed = {p.name for p in site.iterdir() if p.is_dir() and not p.name.endswith(".dist-info")}
    return installed, r.stdout.strip().splitlines()[-1], r.stderr


TE = ["transformer_engine", "transformer_engine_torch", "nvdlfw_inspect"]


def test_without_te_core_library_the_te_wheels_are_left_out_and_said_so(tmp_path):
    installed, note, err = _install(tmp_path, ["megarl_probe_pkg"] + TE)
    assert installed == {"megarl_probe_pkg"}, installed
    assert note.startswith("NOTE=Transformer Engine not installed from WHEELS: no TE core library wheel "
                           "(transformer_engine_cu*)"), note
    for name in TE:
        assert f"{name}-1.0-py3-none-any.whl" in note
    assert f"note: {note[len('NOTE='):]}" in err


def test_with_te_core_library_every_te_wheel_is_installed(tmp_path):
    installed, note, _ = _install(tmp_path, ["megarl_probe_pkg", "transformer_engine_cu13"] + TE)
    assert installed == {"megarl_probe_pkg", "transformer_engine_cu13", *TE}, installed
    assert note == "NOTE="
