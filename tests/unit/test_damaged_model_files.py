"""A model directory with a damaged file (an interrupted download) is refused in one line naming the file, what is
wrong with it and what to do, by every command that reads it, before any rank starts: no traceback."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megarl import cli, verify
from megarl.bridge.hf_config import INDEX_FILE, ModelFileError, check_weight_files, load_spec

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "grpo_tiny_cpu.yaml")


@pytest.fixture(scope="module")
def intact(tmp_path_factory) -> Path:
    from tests.helpers.tiny_models import make_tiny_model

    return make_tiny_model("qwen2", tmp_path_factory.mktemp("intact") / "model")  # sharded, with an index


def _shards(d: Path) -> list:
    return sorted(d.glob("*.safetensors"))


def _truncate(d: Path) -> tuple:
    """Cut the first shard to half its size: (file, its size now, its full size)."""
    shard = _shards(d)[0]
    full = shard.stat().st_size  # an intact file ends where its header's last tensor ends
    with open(shard, "r+b") as f:
        f.truncate(full // 2)
    return shard, f"truncated: {full // 2} of the {full} bytes its header describes"


def _bad_config(d: Path) -> tuple:
    text = (d / "config.json").read_text()
    (d / "config.json").write_text(text[: len(text) // 2])  # cut mid-object
    return d / "config.json", "config.json: not valid JSON"


def _missing_shard(d: Path) -> tuple:
    shard = _shards(d)[-1]
    names = [n for n, f in json.loads((d / INDEX_FILE).read_text())["weight_map"].items() if f == shard.name]
    shard.unlink()
    return shard, f"missing: {INDEX_FILE} puts {len(names)} tensor"


def _not_safetensors(d: Path) -> tuple:
    shard = _shards(d)[1]
    shard.write_text("<html>502 Bad Gateway</html>")  # what a failed download saves under the file's name
    return shard, "not a safetensors file"


DAMAGES = {"truncated": _truncate, "bad_config": _bad_config, "missing_shard": _missing_shard,
           "not_safetensors": _not_safetensors}


@pytest.fixture(params=sorted(DAMAGES))
def damaged(request, intact, tmp_path) -> tuple:
    d = tmp_path / "model"
    shutil.copytree(intact, d)
    file, what = DAMAGES[request.param](d)
    return d, str(file), what


def _one_line(err: str, file: str, what: str) -> str:
    lines = [line for line in err.splitlines() if file in line]
    assert "Traceback" not in err and len(lines) == 1, err
    assert what in lines[0], lines[0]
    return lines[0]


def test_validate_names_the_damaged_file(damaged, capsys):
    d, file, what = damaged
    assert cli.main(["validate", RECIPE, f"model.path={d}", "model.create_tiny=null"]) == 1
    line = _one_line(capsys.readouterr().err, file, what)
    assert f"model.path = '{d}'" in line and "-> download" in line


def test_verify_names_the_damaged_file(damaged, capsys):
    d, file, what = damaged
    assert verify.main(["--hf", str(d)]) == 2
    assert "download" in _one_line(capsys.readouterr().err, file, what)


def test_import_names_the_damaged_file(damaged, tmp_path, capsys):
    d, file, what = damaged
    assert cli.main(["import", "--hf", str(d), "--out", str(tmp_path / "ckpt")]) == 1
    assert "download" in _one_line(capsys.readouterr().err, file, what)
    assert not (tmp_path / "ckpt").exists()  # refused before any rank started


def test_train_refuses_before_starting(intact, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(intact, d)
    file, what = _truncate(d)
    r = subprocess.run([sys.executable, "-m", "megarl", "train", RECIPE, f"model.path={d}", "model.create_tiny=null",
                        f"trainer.run_dir={tmp_path / 'run'}"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1
    _one_line(r.stderr, str(file), what)
    assert not (tmp_path / "run").exists()


def test_a_reward_model_made_by_megarl_says_which_command_makes_it_again(intact, tmp_path, capsys):
    from tests.helpers.tiny_models import make_tiny_model

    rm = make_tiny_model("qwen2", tmp_path / "run_rm" / "rm_model", head="value", tokenizer=False)
    file, what = _truncate(rm)
    assert cli.main(["validate", RECIPE, "reward.reward_model.enable=true", f"reward.reward_model.path={rm}",
                     f"rm.output_dir={rm}"]) == 1
    line = _one_line(capsys.readouterr().err, str(file), what)
    assert line.endswith("-> delete the directory and run `megarl rm` with this recipe again "
                         "(troubleshooting: docs/troubleshooting.md#config-paths)")


def test_bytes_after_the_tensors_and_an_intact_directory(intact, tmp_path):
    load_spec(intact)  # an intact directory opens
    d = tmp_path / "model"
    shutil.copytree(intact, d)
    shard = _shards(d)[0]
    full = shard.stat().st_size
    with open(shard, "ab") as f:
        f.write(b"\0" * 7)
    with pytest.raises(ModelFileError) as exc:
        check_weight_files(d)
    assert exc.value.file == str(shard) and exc.value.problem == f"7 bytes longer than its header describes ({full} bytes)"


def test_a_shard_that_lacks_tensors_of_the_index(intact, tmp_path):
    d = tmp_path / "model"
    shutil.copytree(intact, d)
    first, second = _shards(d)[:2]
    shutil.copy(second, first)  # the index still puts the first shard's tensors in it
    with pytest.raises(ModelFileError, match="lacks .* tensors that model.safetensors.index.json puts in it"):
        load_spec(d)
