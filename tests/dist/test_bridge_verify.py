"""`megarl verify`: starts its own ranks as a plain command, uses the given ranks under a launcher, exits non-zero
above the tolerance and on a layout the checkpoint cannot take."""
import pytest

from megarl.launch_local import run_ranks
from megarl.verify import main
from tests.helpers.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    return str(make_tiny_model("qwen2", tmp_path_factory.mktemp("verify") / "qwen2", seed=7))


def test_plain_command_starts_ranks_and_fails_above_tolerance(qwen2_dir, capsys):
    code = main(["--hf", qwen2_dir, "--tp", "2", "--seq-len", "32", "--batch", "3", "--tol", "1e-12"])
    out = capsys.readouterr().out
    assert "TP=2 PP=1 EP=1" in out and "batch from tokenizer" in out
    assert "max abs logprob difference" in out and "FAILED" in out
    assert code == 1
    diff = float(out.split("max abs logprob difference ")[1].split()[0])
    assert 0 < diff < 1e-5  # the same run passes at the default tolerance
    assert len([line for line in out.splitlines() if line.strip()[:1].isdigit()]) == 3  # one row per sequence


def verify_under_launcher(argv):
    return main(argv)


def test_under_a_launcher_uses_the_given_ranks(qwen2_dir):
    codes = run_ranks(f"{__name__}:verify_under_launcher", 2,
                      {"argv": ["--hf", qwen2_dir, "--pp", "2", "--seq-len", "24", "--batch", "2"]}, timeout=600)
    assert codes == [0, 0]


def test_bad_layout_is_refused_before_starting_ranks(qwen2_dir, capsys):
    assert main(["--hf", qwen2_dir, "--tp", "3"]) == 2
    assert "tensor_model_parallel_size=3 does not divide num_attention_heads=4" in capsys.readouterr().err
