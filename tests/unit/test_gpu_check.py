"""`make gpu-check` (scripts/gpu_check.sh) on a machine without a usable CUDA Python stops in one line with a non-zero
exit before writing anything; its wheels folder installs Transformer Engine only together with TE's core library.
Its own logic (caps, budget, n/a steps, summary, exit code) runs here with the machine's probes and the steps'
commands played by a stub (GPU_CHECK_STUB)."""
import ast
import os
import re
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


# The machine and the steps, played: no CUDA, TE as STUB_TE says, every step passes but those named in STUB_FAIL; each
# step's log records the command the check would have run.
STUB = """
find_python() { GPU_PY=$STUB_PY; }
describe_machine() { say "gpu: simulated"; }
probe_te() { echo "$STUB_TE"; }
execute() { echo "$*" > "$LOGS/$1.log"; case " ${STUB_FAIL:-} " in *" $1 "*) return 3;; esac; }
"""
TE_ABSENT = "not installed; the TE steps are n/a"
TE_PRESENT = "2.11.0, imports"
PRESENT_WITHOUT_TE = ["tests-no-te", "models", "verify-fp32-no-te", "bench-train", "bench-ipc", "doctor"]


def _played(tmp_path, te=TE_ABSENT, fail="", *args, **env_extra):
    stub = tmp_path / "stub.sh"
    stub.write_text(STUB)
    r = _check(tmp_path, *args, GPU_CHECK_STUB=str(stub), STUB_PY=sys.executable, STUB_TE=te, STUB_FAIL=fail,
               **env_extra)
    summary = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    return r, summary


def _verdicts(summary):
    return {m.group(2): m.group(1) for m in map(re.compile(r"^(PASS|FAIL|SKIP|n/a) +([\w-]+)").match, summary) if m}


def test_without_te_its_steps_are_na_and_the_check_passes_when_every_present_step_does(tmp_path):
    r, summary = _played(tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _verdicts(summary) == {**{name: "PASS" for name in PRESENT_WITHOUT_TE},
                                  "tests-te": "n/a", "verify-fp32-te": "n/a"}, summary
    assert "n/a   tests-te (TE not installed)" in summary
    assert "n/a   verify-fp32-te (TE not installed)" in summary
    assert ("not shown: tests-te (TE not installed); verify-fp32-te (TE not installed); bench-train's megarl TE row "
            "(TE not installed)") in summary
    assert summary[-1].startswith("result: all 6 steps that could run here passed in "), summary[-1]


def test_a_te_that_does_not_import_makes_its_steps_na_with_that_reason(tmp_path):
    r, summary = _played(tmp_path, te="does not import (libtransformer_engine.so: cannot open shared object file)")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "n/a   tests-te (TE does not import)" in summary


def test_a_present_step_that_fails_fails_the_check(tmp_path):
    r, summary = _played(tmp_path, fail="bench-ipc")
    assert r.returncode == 1
    assert _verdicts(summary)["bench-ipc"] == "FAIL"
    assert "FAIL  bench-ipc: exit code 3 after 0 s (logs.tgz: logs/bench-ipc.log)" in summary
    assert summary[-1].startswith("result: 1 of 6 steps failed or were not run (bench-ipc) in "), summary[-1]


def test_with_te_its_steps_run_and_a_failure_there_fails_the_check(tmp_path):
    r, summary = _played(tmp_path, te=TE_PRESENT, fail="tests-te")
    assert r.returncode == 1
    assert _verdicts(summary) == {**{name: "PASS" for name in PRESENT_WITHOUT_TE},
                                  "tests-te": "FAIL", "verify-fp32-te": "PASS"}, summary
    assert not any(line.startswith("not shown:") for line in summary)


def _caps(stdout):
    """{step: its cap} from the check's '..    NAME (at most N s)' lines, and the budget its plan line names."""
    caps = {m.group(1): int(m.group(2)) for m in re.finditer(r"^\.\.    ([\w-]+) \(at most (\d+) s\)$", stdout, re.M)}
    planned = re.search(r"^plan: .* = (\d+) s of the (\d+) s budget$", stdout, re.M)
    return caps, int(planned.group(1)), int(planned.group(2))


def test_without_te_the_step_caps_leave_a_fifth_of_the_budget_spare(tmp_path):
    r, _ = _played(tmp_path)
    caps, planned, budget = _caps(r.stdout)
    assert sorted(caps) == sorted(PRESENT_WITHOUT_TE)
    assert budget == 480  # GPU_CHECK_BUDGET_S's default, docs/gpu.md
    assert planned == sum(caps.values())
    assert sum(caps.values()) <= 384, caps  # 0.8 x 480: a step at its cap still leaves the later ones theirs


def test_with_te_its_steps_bring_their_share_of_the_budget(tmp_path):
    r, _ = _played(tmp_path, te=TE_PRESENT)
    caps, planned, budget = _caps(r.stdout)
    assert {"tests-te", "verify-fp32-te"} <= set(caps)
    assert planned == sum(caps.values()) and sum(caps.values()) <= 0.8 * budget, (caps, budget)


def test_a_spent_budget_leaves_steps_not_run_and_says_so(tmp_path):
    r, summary = _played(tmp_path, GPU_CHECK_BUDGET_S="20")
    assert r.returncode == 1
    assert _verdicts(summary)["doctor"] == "SKIP"
    assert "doctor (not run: the budget was spent)" in [line for line in summary if line.startswith("not shown:")][0]


def test_the_tests_step_leaves_the_benchmark_and_doctor_to_their_own_steps(tmp_path):
    """No step runs twice: the gpu-marked tests that run bench_train.py at 1.1B and megarl doctor are deselected there
    (and still exist: pytest ignores a --deselect that names no test)."""
    _played(tmp_path)
    logs = tmp_path / "logs"
    subprocess.run(["tar", "-xzf", str(tmp_path / "out" / "logs.tgz"), "-C", str(tmp_path)], check=True)
    command = (logs / "tests-no-te.log").read_text()
    deselected = re.findall(r"--deselect (\S+)", command)
    assert sorted(deselected) == [
        "tests/e2e/test_doctor.py::test_doctor_passes_on_the_gpu",
        "tests/gpu/test_gpu_training.py::test_bench_train_reports_tokens_per_second_and_mfu_for_a_1b_model"]
    for node in deselected:
        path, name = node.split("::")
        tree = ast.parse((ROOT / path).read_text())
        assert name in {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}, node
