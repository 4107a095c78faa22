"""bench/bench_train.py runs on CPU (the GPU tier runs both sizes): megarl without TE and plain torch step, the table is
printed with peak memory, the profiler's top operators, the offload round trip of megarl's states, and the speed
target's line."""
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_train_runs_on_cpu_with_a_small_model():
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_train.py"), "--hidden", "64", "--layers", "1",
                          "--vocab", "256", "--seq", "32", "--steps", "1", "--warmup", "0", "--profile", "3",
                          "--offload"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in (r"megarl no TE", r"plain torch \(HF \+ AdamW\)"):
        row = re.search(name + r"\s+([\d.]+)\s+(\d+)\s+[\d.]+\s+n/a\s+[\d.]+x\s+nan", out.stdout)
        assert row and float(row.group(1)) > 0 and int(row.group(2)) > 0, out.stdout
    assert "MFU peak: n/a (unknown: pass --peak-tflops)" in out.stdout
    assert "megarl no TE: SDPAttention; fusions: none" in out.stdout
    offload = re.search(r"offload round trip \(megarl no TE.*?\): ([\d.]+) MiB .* states unchanged: True", out.stdout)
    assert offload and float(offload.group(1)) > 0, out.stdout
    assert len(re.findall(r"^\s+[\d.]+%\s+[\d.]+ ms  \S", out.stdout, re.M)) == 6  # top 3 of each contender
    assert re.search(r"host staging [\d.]+ MiB \(released after\)", out.stdout), out.stdout
    # the speed target is a line of the benchmark (MET or SHORT with the ratio), not its exit code
    target = re.search(r"^target: megarl no TE >= 1\.00x plain torch \[custom\]: (MET|SHORT) \(([\d.]+)x\)$",
                       out.stdout, re.M)
    assert target and float(target.group(2)) > 0, out.stdout
