"""bench/bench_train.py runs on CPU (the GPU tier runs it on a 1B model): both trainers step and the table is printed."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_runs_on_cpu_with_a_small_model():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train.py"), "--hidden", "64", "--layers", "1",
                          "--vocab", "256", "--seq", "32", "--steps", "1", "--warmup", "0"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in (r"megarl \(megatron-core\)", r"plain torch \(HF \+ AdamW\)"):
        row = re.search(name + r"\s+([\d.]+)\s+(\d+)\s+[\d.]+\s+n/a\s+[\d.]+x", out.stdout)
        assert row and float(row.group(1)) > 0 and int(row.group(2)) > 0, out.stdout
    assert "MFU peak: n/a (unknown: pass --peak-tflops)" in out.stdout
