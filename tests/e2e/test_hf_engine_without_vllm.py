"""A Python that cannot import vLLM (simulated: a sitecustomize on PYTHONPATH makes vllm unimportable in each process
megarl starts, ranks and engine processes included):

* `megarl train` with rollout.name=vllm fails at once, before any rank or engine process starts, with one line saying
  that rollout.name=vllm needs vLLM and that rollout.name=hf is the alternative;
* with rollout.name=hf the same recipe trains (slow: SFT warm-start and GRPO steps on the tiny recipe);
* `megarl verify --engine hf`: megarl's weights through the sync into the transformers engine give megarl's logprobs
  within verify's derived float32 bound (tests/helpers/bounds.py).
"""
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.bounds import verify_bound
from tests.helpers.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]
# as on a machine without vLLM: `import vllm` raises ModuleNotFoundError and importlib finds no spec
HOOK = '''
import sys

sys.modules["vllm"] = None
'''
SMALL = ["data.synthetic.num_train=64", "data.synthetic.num_val=16", "sft.total_steps=2", "sft.optim.lr_warmup_steps=0",
         "trainer.total_steps=2", "trainer.test_freq=0", "trainer.val_before_train=false", "logging.tensorboard=false"]


def without_vllm(tmp_path: Path, *args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    hook = tmp_path / "novllm"
    hook.mkdir(exist_ok=True)
    (hook / "sitecustomize.py").write_text(HOOK)
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{ROOT}")
    return subprocess.run([sys.executable, "-m", "megarl", *args], capture_output=True, text=True, cwd=ROOT, env=env,
                          timeout=timeout)


def train_args(tmp_path: Path, name: str) -> list:
    run = tmp_path / name
    return ["train", "recipes/grpo_tiny_cpu.yaml", f"trainer.run_dir={run}", f"model.path={run / 'init_model'}",
            f"data.synthetic.output_dir={run / 'data'}", f"sft.output_dir={run / 'sft'}", *SMALL]


def test_train_with_vllm_engine_fails_at_once_naming_the_hf_engine(tmp_path):
    t0 = time.perf_counter()
    r = without_vllm(tmp_path, *train_args(tmp_path, "vllm"), timeout=300)
    seconds = time.perf_counter() - t0
    assert r.returncode != 0
    lines = [line for line in r.stderr.splitlines() if "needs vLLM" in line]
    assert len(lines) == 1 and "rollout.name=vllm needs vLLM" in lines[0] and "rollout.name=hf" in lines[0], r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    # refused while loading the recipe: nothing was created, no rank or engine process started
    assert not (tmp_path / "vllm").exists(), sorted(p.name for p in (tmp_path / "vllm").iterdir())
    print(f"[measured] refused in {seconds:.1f} s: {lines[0]}")


@pytest.mark.slow  # an SFT warm-start and two GRPO steps with the hf engine, no vLLM in any process
def test_train_with_hf_engine_without_vllm(tmp_path):
    r = without_vllm(tmp_path, *train_args(tmp_path, "hf"), "rollout.name=hf")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "hf" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(row["rollout/num_samples"] > 0 for row in rows), rows


@pytest.mark.slow  # trainer TP2 into the hf engine, default suite: tests/dist/test_hf_engine_sync.py[tp2-dense]
def test_verify_engine_hf_without_vllm(tmp_path):
    hf_dir = make_tiny_model("qwen2", tmp_path / "qwen2")  # tied embeddings, QKV bias
    r = without_vllm(tmp_path, "verify", "--hf", str(hf_dir), "--engine", "hf", "--tp", "2")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checksums verified" in r.stdout and "(hf vs megarl" in r.stdout, r.stdout
    diff = float(r.stdout.split("max abs logprob difference ")[1].split()[0].rstrip(";"))
    tol = verify_bound(hf_dir, 64, 4)  # verify's default batch: 4 sequences of up to 64 tokens
    print(f"[measured] verify --engine hf --tp 2: hf engine vs megarl {diff:.2e} (bound {tol:.2e})")
    assert diff < tol, (diff, tol)


@pytest.mark.slow  # the doctor's megatron probes and an engine process
def test_doctor_probes_the_hf_engine_without_vllm(tmp_path):
    r = without_vllm(tmp_path, "doctor")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "PASS  hf engine (vLLM does not import) first tokens" in r.stdout, r.stdout
