"""Output capture: library output (Python, C-level writes, logging, warnings) goes to the process's log file, the
user's lines and errors reach the terminal; the engine process logs to its own file; wandb logs offline."""
import glob
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from megarl import console
from megarl.config import ConfigError
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]

RANK_SCRIPT = textwrap.dedent("""
    import logging, os, sys, warnings
    from megarl import console

    with console.captured("rank0"):
        console.setup_logging("INFO", is_rank0=True)
        print("library print")
        os.write(2, b"C-level warning\\n")
        warnings.warn("a library UserWarning")
        logging.getLogger("vllm").info("vllm info")
        logging.getLogger("megarl").info("megarl progress")
        console.say("step 1/1  train/reward_mean 0.5")
        if sys.argv[1] == "fail":
            raise RuntimeError("the original error")
""")


def _run_rank(tmp_path, mode: str, verbose: str = "0") -> subprocess.CompletedProcess:
    env = dict(os.environ, MEGARL_LOG_DIR=str(tmp_path / "logs"), MEGARL_VERBOSE=verbose)
    return subprocess.run([sys.executable, "-c", RANK_SCRIPT, mode], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)


def test_quiet_process_keeps_library_output_in_its_log(tmp_path):
    proc = _run_rank(tmp_path, "ok")
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "rank0.log").read_text()
    for text in ("library print", "C-level warning", "a library UserWarning", "vllm info", "megarl progress"):
        assert text in log
    terminal = proc.stdout + proc.stderr
    assert "step 1/1  train/reward_mean 0.5" in terminal and "megarl progress" in terminal
    for text in ("library print", "C-level warning", "UserWarning", "vllm info"):
        assert text not in terminal
    assert "logs of vLLM, Megatron and each rank" in proc.stderr  # where to look, said once


def test_failing_process_shows_its_error_on_the_terminal(tmp_path):
    proc = _run_rank(tmp_path, "fail")
    assert proc.returncode == 1
    assert "RuntimeError: the original error" in proc.stderr
    assert "library print" not in proc.stderr


def test_verbose_shows_everything_and_still_writes_the_log(tmp_path):
    proc = _run_rank(tmp_path, "ok", verbose="1")
    assert proc.returncode == 0, proc.stderr
    terminal = proc.stdout + proc.stderr
    log = (tmp_path / "logs" / "rank0.log").read_text()
    for text in ("library print", "C-level warning", "vllm info", "step 1/1"):
        assert text in terminal and text in log


def test_without_a_log_dir_nothing_is_captured(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "MEGARL_LOG_DIR"}
    proc = subprocess.run([sys.executable, "-c", RANK_SCRIPT, "ok"], capture_output=True, text=True, env=env,
                          timeout=120, cwd=ROOT)
    assert "library print" in proc.stdout and "C-level warning" in proc.stderr


ENGINE_SCRIPT = textwrap.dedent("""
    import os, sys
    import multiprocessing as mp
    from megarl.console import capture_engine_output

    def engine():
        capture_engine_output()
        print("INFO vllm engine start-up", flush=True)
        import logging
        logging.getLogger("megarl.rollout.vllm.engine").info("engine started; replica 1: node 0")
        os.write(2, b"W engine C++ warning\\n")

    if __name__ == "__main__":
        p = mp.get_context("spawn").Process(target=engine, name="megarl-vllm-engine")
        p.start(); p.join()
        sys.exit(p.exitcode)
""")


def test_engine_process_logs_to_its_own_file(tmp_path, monkeypatch):
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    env = dict(os.environ, MEGARL_LOG_DIR=str(tmp_path / "logs"), MEGARL_VERBOSE="0")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "logs" / "vllm-engine.log").read_text()
    assert "INFO vllm engine start-up" in log and "W engine C++ warning" in log
    # megarl's own INFO lines of the engine process (the start line naming its node) land there too
    assert "INFO megarl.rollout.vllm.engine: engine started; replica 1: node 0" in log
    assert "engine" not in proc.stdout + proc.stderr
    # what the trainer quotes when the engine process dies
    monkeypatch.setenv("MEGARL_LOG_DIR", str(tmp_path / "logs"))
    tail = console.log_tail("vllm-engine", lines=1)
    assert tail == f"the last lines of {tmp_path / 'logs' / 'vllm-engine.log'}:\nW engine C++ warning"
    monkeypatch.delenv("MEGARL_LOG_DIR")
    assert console.log_tail("vllm-engine") == ""


WANDB_SCRIPT = textwrap.dedent("""
    import sys
    from megarl.config.schema import WandbConfig
    from megarl.metrics import MetricsLogger

    logger = MetricsLogger(sys.argv[1], tensorboard=False, console=False, total_steps=3,
                           wandb=WandbConfig(enable=True, project="megarl-test"), config={"rollout": {"n": 4}})
    for step in (1, 2, 3):
        logger.log(step, {"train/reward_mean": step / 4, "actor/kl": float("nan")})
    logger.close()
""")


def test_wandb_logs_offline_under_the_run_dir(tmp_path):
    env = dict(os.environ, WANDB_MODE="offline", WANDB_SILENT="true")
    proc = subprocess.run([sys.executable, "-c", WANDB_SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(runs) == 1
    data = Path(runs[0]).read_bytes()
    assert b"train/reward_mean" in data and b"actor/kl" not in data  # NaN (null) values are not sent
    for value in (b"0.25", b"0.5", b"0.75"):  # each step's value, JSON-encoded in the run's record log
        assert value in data


def test_wandb_without_the_package_is_refused_at_validate(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    try:
        load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", ["logging.wandb.enable=true"])
    except ConfigError as exc:
        assert "logging.wandb.enable = True: the wandb package is not installed" in str(exc)
        assert "pip install 'megarl[wandb]'" in str(exc)
    else:
        raise AssertionError("validate accepted logging.wandb.enable without wandb")
