"""`make test-gpu` (scripts/gpu_tests.sh, scripts/gpu_env.sh) on a machine without a usable CUDA Python: it stops with
one line and a non-zero exit instead of skipping every gpu test, refuses the CPU env, and its WHEELS folder installs
what the machine's Python lacks without ever installing a torch wheel."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(env_extra, script="scripts/gpu_tests.sh"):
    env = {k: v for k, v in os.environ.items() if k not in ("GPU_PYTHON", "GPU_VENV", "WHEELS")}
    env.update(env_extra)
    return subprocess.run(["bash", script], capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_the_cpu_env_is_refused_with_one_line_and_a_nonzero_exit():
    r = _run({"GPU_PYTHON": sys.executable})
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: megarl's GPU checks (make test-gpu, gpu-check) need a CUDA GPU"), r.stderr
    import torch

    if not torch.cuda.is_available():
        assert "CPU build" in lines[0] or "no CUDA device" in lines[0]
    assert "passed" not in r.stdout and "skipped" not in r.stdout  # pytest never started


def test_a_missing_interpreter_is_named():
    r = _run({"GPU_PYTHON": "/nonexistent/python"})
    assert r.returncode == 1 and "/nonexistent/python" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def _wheel(folder: Path, name: str, module: str) -> Path:
    dist = f"{name}-1.0.dist-info"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", f"NAME = {name!r}\n")
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        z.writestr(f"{dist}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}/RECORD", "")
    return path


def test_wheels_are_installed_into_the_site_folder_but_never_torch(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "megarl_probe_pkg", "megarl_probe_pkg")
    _wheel(wheels, "torch", "torch_should_not_be_here")
    site = tmp_path / "site"
    cmd = (f". scripts/gpu_env.sh; GPU_PY={sys.executable}; GPU_SITE={site}; WHEELS={wheels}; _gpu_wheels && "
           f"PYTHONPATH={site} {sys.executable} -c 'import megarl_probe_pkg; print(megarl_probe_pkg.NAME)'")
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "megarl_probe_pkg"
    assert "skipping torch-1.0-py3-none-any.whl" in r.stderr
    assert not (site / "torch_should_not_be_here").exists() and not list(site.glob("torch-*"))
