"""scripts/check_cpu_torch.py, run by `make env` before it installs anything: it refuses a torch that pip would take
from an index serving the CUDA build (the case where the CPU wheels are not reachable), in one line naming the
variable to set, and accepts the CPU build. The indexes here are folders of hand-made wheels, with pip's own
configuration switched off."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_cpu_torch  # noqa: E402


def _wheel(folder: Path, name: str, version: str, requires: tuple = ()) -> None:
    """A minimal pure-Python wheel: its metadata is all pip's dry run reads."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", meta)
        z.writestr(f"{dist}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                              "Tag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")


def _index_env(folder: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_NO_INDEX="1", PIP_FIND_LINKS=str(folder),
               PIP_DISABLE_PIP_VERSION_CHECK="1")
    return env


def test_a_cuda_torch_is_refused_in_one_line_naming_the_variable(tmp_path):
    _wheel(tmp_path, "torch", "2.13.0", ('nvidia-cublas-cu12==12.8.4.1; platform_system == "Linux"',))
    _wheel(tmp_path, "nvidia-cublas-cu12", "12.8.4.1")
    out = subprocess.run([sys.executable, "scripts/check_cpu_torch.py", "torch==2.13.0"], cwd=ROOT,
                         capture_output=True, text=True, env=_index_env(tmp_path))
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "CUDA build of torch 2.13.0" in lines[0] and "PIP_EXTRA_INDEX_URL" in lines[0], lines


def test_the_cpu_build_passes(tmp_path):
    _wheel(tmp_path, "torch", "2.13.0+cpu", ("filelock",))
    _wheel(tmp_path, "filelock", "3.0.0")
    items = check_cpu_torch.planned_install(["torch==2.13.0"], env=_index_env(tmp_path))
    assert {i["metadata"]["name"] for i in items} == {"torch", "filelock"}
    assert check_cpu_torch.planned_torch_problem(items) is None


def test_a_cu_version_or_nvidia_requirement_marks_a_cuda_build():
    assert check_cpu_torch.cuda_markers("torch", "2.13.0+cu128", []) == ["torch 2.13.0+cu128"]
    assert check_cpu_torch.cuda_markers("torch", "2.13.0", ['nvidia-nccl-cu12==2.27.3; platform_system == "Linux"',
                                                            "filelock"]) == ["nvidia-nccl-cu12"]
    assert check_cpu_torch.cuda_markers("torch", "2.13.0+cpu", ["filelock", "sympy>=1.13"]) == []


def test_a_cuda_torch_left_by_an_earlier_install_names_clean_env(tmp_path):
    """pip keeps an installed CUDA torch 2.13.0 (it satisfies torch==2.13.0): only a fresh environment removes it."""
    site = tmp_path / "site"
    info = site / "torch-2.13.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torch\nVersion: 2.13.0\n"
                                   "Requires-Dist: nvidia-cudnn-cu12==9.10; platform_system == \"Linux\"\n")
    env = _index_env(tmp_path)  # no wheels here: the check must stop before asking pip
    env["PYTHONPATH"] = str(site)
    out = subprocess.run([sys.executable, "scripts/check_cpu_torch.py", "torch==2.13.0"], cwd=ROOT,
                         capture_output=True, text=True, env=env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr
    assert "make clean-env" in lines[0] and "nvidia-cudnn-cu12" in lines[0] and "PIP_EXTRA_INDEX_URL" in lines[0]
