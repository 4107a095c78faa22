"""`megarl doctor` passes on this machine: versions next to the tested ones, the devices, and its probes (megatron
forward vs HF, one update vs torch; the vLLM engine's first tokens in the slow and GPU tiers), exit 0."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _doctor(*args):
    return subprocess.run([sys.executable, "-m", "megarl", "doctor", *args], capture_output=True, text=True,
                          timeout=900, cwd=ROOT)


def _check(r, probes):
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for row in ("megatron-core", "transformer-engine", "vllm", "ray", "nccl", "devices:"):
        assert row in r.stdout
    for probe in probes:
        assert f"PASS  {probe}:" in r.stdout, r.stdout
    assert "FAIL" not in r.stdout


def test_doctor_passes_without_the_engine_probe():
    r = _doctor("--skip-engine")
    _check(r, ("megatron forward vs HF", "actor update vs torch"))
    assert "doctor: 2 of 2 checks passed" in r.stdout


@pytest.mark.slow
def test_doctor_passes_with_the_engine_probe():
    _check(_doctor(), ("megatron forward vs HF", "actor update vs torch", "vLLM engine first tokens"))


@pytest.mark.gpu
def test_doctor_passes_on_the_gpu():
    r = _doctor()
    _check(r, ("megatron forward vs HF", "actor update vs torch"))
    assert "on cuda" in r.stdout
