"""Errors whose message says the cause and the fix reach the console as one line from any rank, never a traceback."""
import pytest

from megarl.launch_local import RankFailure, run_ranks


def fail_explained():
    from megarl.rollout.vllm.engine_args import EngineStartError

    raise EngineStartError("rollout engine failed to start: the cause; Fix: set rollout.x")


def fail_unexpected():
    raise KeyError("a bug")


def test_an_explained_error_is_one_line_from_a_rank(tmp_path):
    with pytest.raises(RankFailure):
        run_ranks(f"{__name__}:fail_explained", 1, timeout=120, log_dir=str(tmp_path))
    log = (tmp_path / "rank0.log").read_text()
    lines = [line for line in log.splitlines() if line.startswith("megarl: rank 0:")]
    assert lines == ["megarl: rank 0: rollout engine failed to start: the cause; Fix: set rollout.x"], log
    assert "Traceback" not in log


def test_an_unexpected_error_keeps_its_traceback(tmp_path):  # a bug must show where it is
    with pytest.raises(RankFailure):
        run_ranks(f"{__name__}:fail_unexpected", 1, timeout=120, log_dir=str(tmp_path))
    assert "Traceback" in (tmp_path / "rank0.log").read_text()


def test_verify_refuses_a_missing_lora_adapter_in_one_line(tmp_path, capsys):
    from megarl.verify import main
    from tests.helpers.tiny_models import make_tiny_model

    hf = make_tiny_model("qwen3", tmp_path / "m", tokenizer=False)
    capsys.readouterr()  # the model writer's progress bar
    assert main(["--hf", str(hf), "--lora", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no adapter_config.json" in err and "Traceback" not in err


@pytest.mark.parametrize("flag,value", [("--cp", "0"), ("--tp", "-1"), ("--ep", "two")])
def test_verify_refuses_a_parallel_size_below_one_as_a_usage_error(flag, value, capsys):
    from megarl.verify import parse_args

    with pytest.raises(SystemExit) as exc:  # argparse: exit code 2 and one line, before any rank starts
        parse_args(["--hf", "x", flag, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == f"megarl verify: error: argument {flag}: a parallel size is an integer >= 1, got '{value}'"
