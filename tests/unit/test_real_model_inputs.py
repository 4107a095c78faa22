"""A real model's inputs that would fail only once ranks, engines or the first validation pass run are refused by
`megarl validate` (and so by `megarl train`'s start) in one line naming the key, the value, the rule and the fix: a
model directory without its tokenizer, a GGUF file in place of a Hugging Face directory, and prompt rows whose
data_source routes to no reward function."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl import cli
from megarl.config import ConfigError
from megarl.validate import load_config
from megarl.validate.paths import has_tokenizer

ROOT = Path(__file__).resolve().parents[2]
RECIPE = str(ROOT / "recipes" / "grpo_tiny_cpu.yaml")
TOKENIZER_NAMES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.helpers.tiny_models import make_tiny_model

    return make_tiny_model("llama", tmp_path_factory.mktemp("good") / "model", max_shard_size=None)


@pytest.fixture(scope="module")
def no_tokenizer(model, tmp_path_factory) -> Path:
    """The model as a conversion or a partial download leaves it: config.json and weights, no tokenizer file."""
    d = tmp_path_factory.mktemp("notok") / "model"
    shutil.copytree(model, d)
    for name in TOKENIZER_NAMES:
        (d / name).unlink()
    assert not any("token" in p.name for p in d.iterdir())
    return d


def _base(tmp_path) -> list:
    return [f"trainer.run_dir={tmp_path / 'run'}", "model.create_tiny=null"]


def _refusal(overrides: list, key: str) -> str:
    with pytest.raises(ConfigError) as exc:
        load_config(RECIPE, overrides)
    mine = [i for i in exc.value.issues if i.key == key]
    assert len(mine) == 1, exc.value
    line = mine[0].line()
    assert "\n" not in line, line
    return line


def test_a_good_directory_and_registered_data_sources_pass(model, tmp_path):
    rows = [{"prompt": "1+1?", "ground_truth": "2", "data_source": s} for s in ("openai/gsm8k", "gsm8k", "ARITHMETIC")]
    train = _jsonl(tmp_path / "train.jsonl", rows)
    load_config(RECIPE, _base(tmp_path) + [f"model.path={model}", f"data.train_files=[{train}]"])


def test_a_model_directory_made_at_run_time_is_not_looked_into(tmp_path):
    # model.create_tiny writes it (tokenizer included) and data.synthetic its data, both after validate
    load_config(RECIPE, [f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'init'}",
                         f"data.train_files=[{tmp_path / 'run' / 'data' / 'train.parquet'}]"])


def test_a_model_without_tokenizer_is_refused(no_tokenizer, tmp_path):
    from transformers import AutoTokenizer

    with pytest.raises(Exception):  # what the rule spares the user: rank 0's failure, after start-up
        AutoTokenizer.from_pretrained(str(no_tokenizer))
    line = _refusal(_base(tmp_path) + [f"model.path={no_tokenizer}"], "model.path")
    assert line.startswith(f"model.path = '{no_tokenizer}': has config.json and weights but no tokenizer (expected "
                           "tokenizer.json, tokenizer.model, or tokenizer_config.json with vocab.json + merges.txt) "
                           "-> copy the tokenizer files"), line
    assert "from the original model" in line and "model.tokenizer_path does not replace them" in line


@pytest.mark.parametrize("key,enable", [
    ("reward.reward_model.path", ["reward.reward_model.enable=true"]),
    ("reward.judge.path", ["reward.judge.enable=true", "reward.judge.parser=number"]),
    ("rm.model_path", [])])
def test_other_directories_whose_tokenizer_is_loaded(key, enable, tmp_path):
    from tests.helpers.tiny_models import make_tiny_model

    d = make_tiny_model("qwen2", tmp_path / "m", head="value" if key.startswith("reward.reward_model") else "lm",
                        tokenizer=False, max_shard_size=None)
    overrides = _base(tmp_path) + ["model.create_tiny={}", f"model.path={tmp_path / 'init'}"] + enable
    line = _refusal(overrides + [f"{key}={d}"], key)
    assert "no tokenizer" in line and "copy the tokenizer files" in line, line
    if key == "rm.model_path":  # `megarl rm` reads the tokenizer from model.tokenizer_path when it is set
        assert "or set model.tokenizer_path" in line
        tokenizer = tmp_path / "tok"
        shutil.copytree(d, tokenizer)
        from tests.helpers.tiny_models import make_tokenizer

        make_tokenizer(tokenizer)
        load_config(RECIPE, overrides + [f"{key}={d}", f"model.tokenizer_path={tokenizer}"])


def test_directories_read_with_the_policy_tokenizer_need_none(no_tokenizer, model, tmp_path):
    load_config(RECIPE, _base(tmp_path) + [f"model.path={model}", "algorithm.adv_estimator=gae",
                                           f"critic.model_path={no_tokenizer}", "distillation.enable=true",
                                           f"distillation.teacher.path={no_tokenizer}"])


@pytest.mark.parametrize("files,expected", [
    ({"tokenizer.json"}, True), ({"tokenizer.model"}, True), ({"spiece.model"}, True), ({"vocab.txt"}, True),
    ({"vocab.json", "merges.txt", "tokenizer_config.json"}, True), ({"qwen.tiktoken"}, True),
    ({"tokenizer_config.json"}, False), ({"vocab.json"}, False), ({"special_tokens_map.json"}, False)])
def test_tokenizer_files_by_name(files, expected, tmp_path):
    for name in files | {"config.json", "model.safetensors"}:
        (tmp_path / name).write_text("{}")
    assert has_tokenizer(tmp_path) is expected


def test_tokenizer_of_its_own_code_names_its_files(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": ["t.Tok", None]}}))
    assert has_tokenizer(tmp_path)


def _gguf(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"GGUF\x03\x00\x00\x00")  # the magic and version: the rule reads the name only
    return path


def _assert_gguf_line(line: str, gguf: Path) -> None:
    assert "GGUF file" in line and "megarl needs a Hugging Face directory (config.json, safetensors, tokenizer)" in line
    assert "`megarl get-model smollm2-135m-instruct --out DIR`" in line, line
    assert f"from_pretrained('{gguf.parent}', gguf_file='{gguf.name}')" in line and "save_pretrained(DIR)" in line


def test_a_gguf_file_is_refused(tmp_path):
    gguf = _gguf(tmp_path / "dl" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    line = _refusal(_base(tmp_path) + [f"model.path={gguf}"], "model.path")
    assert line.startswith(f"model.path = '{gguf}': is a GGUF file; "), line
    _assert_gguf_line(line, gguf)


def test_a_gguf_directory_is_refused(model, tmp_path):
    gguf = _gguf(tmp_path / "dl" / "model.Q8_0.gguf")
    line = _refusal(_base(tmp_path) + [f"model.path={gguf.parent}"], "model.path")
    assert line.startswith(f"model.path = '{gguf.parent}': holds a GGUF file (model.Q8_0.gguf) and no config.json"), \
        line
    _assert_gguf_line(line, gguf)
    # with the config beside it (as some GGUF repositories ship) the missing weights are still the GGUF's
    shutil.copy(model / "config.json", gguf.parent / "config.json")
    line = _refusal(_base(tmp_path) + [f"model.path={gguf.parent}"], "model.path")
    assert "holds a GGUF file (model.Q8_0.gguf) and no *.safetensors weights" in line
    _assert_gguf_line(line, gguf)


# -- data_source without a reward -------------------------------------------------------------------------------------


def _jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _parquet(path: Path, rows: list) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _rows(sources: dict) -> list:
    return [{"prompt": [{"role": "user", "content": "What is 2 + 2 ?"}], "ground_truth": "4", "data_source": s,
             "extra_info": {"data_source": "nested, not the row's"}} for s, n in sources.items() for _ in range(n)]


@pytest.mark.parametrize("write", [_parquet, _jsonl], ids=["parquet", "jsonl"])
def test_rows_whose_data_source_has_no_reward_are_refused(write, model, tmp_path):
    path = write(tmp_path / f"train.{write.__name__[1:]}", _rows({"gsm8k": 2, "my_task": 3, "other": 1}))
    line = _refusal(_base(tmp_path) + [f"model.path={model}", f"data.train_files=[{path}]"], "data.train_files[0]")
    assert line.startswith(f"data.train_files[0] = '{path}': no reward function for data_source 'my_task' (3 rows), "
                           "'other' (1 row): reward.reward_fn is unset"), line
    assert "registered: ['arithmetic', 'exact_match', 'format_regex', 'format_think_answer', 'geo3k', 'gsm8k'" in line
    assert "aliases: [" in line and "'openai/gsm8k'" in line
    assert ("-> set reward.reward_fn to a registered name or 'path/to/file.py:function'" in line
            and "register_reward(NAME, fn, aliases=['my_task'])" in line), line
    # a reward function for every row: nothing is routed
    load_config(RECIPE, _base(tmp_path) + [f"model.path={model}", f"data.train_files=[{path}]",
                                           "reward.reward_fn=gsm8k"])


def test_which_rows_are_routed(model, tmp_path):
    """Train rows scored by the reward model alone need no rule; validation is always scored by the rule."""
    from tests.helpers.tiny_models import make_tiny_model

    rm = make_tiny_model("qwen2", tmp_path / "rm", head="value", max_shard_size=None)
    unknown = _jsonl(tmp_path / "rows.jsonl", _rows({"my_task": 2}))
    with_rm = _base(tmp_path) + [f"model.path={model}", "reward.reward_model.enable=true",
                                 f"reward.reward_model.path={rm}", f"data.train_files=[{unknown}]"]
    load_config(RECIPE, with_rm + ["trainer.val_before_train=false", "trainer.test_freq=0"])
    with pytest.raises(ConfigError) as exc:
        load_config(RECIPE, with_rm + [f"data.val_files=[{unknown}]"])
    assert [i.key for i in exc.value.issues] == ["data.val_files[0]"], exc.value
    # a rule component without its own fn routes the train rows again
    _refusal(with_rm + ["reward.components={rm: {type: reward_model}, acc: {type: rule}}"], "data.train_files[0]")
    load_config(RECIPE, with_rm + ["reward.components={rm: {type: reward_model}, acc: {type: rule, fn: gsm8k}}",
                                   "trainer.val_before_train=false", "trainer.test_freq=0"])


def test_the_data_source_key_is_the_column_read(model, tmp_path):
    rows = [{**r, "task": "gsm8k"} for r in _rows({"my_task": 2})]
    path = _parquet(tmp_path / "train.parquet", rows)
    load_config(RECIPE, _base(tmp_path) + [f"model.path={model}", f"data.train_files=[{path}]",
                                           "data.data_source_key=task"])


# -- through the command line -----------------------------------------------------------------------------------------


def test_validate_command_exits_1_with_one_line_and_no_traceback(no_tokenizer, tmp_path):
    r = subprocess.run([sys.executable, "-m", "megarl", "validate", RECIPE, f"model.path={no_tokenizer}",
                        "model.create_tiny=null", f"trainer.run_dir={tmp_path / 'run'}"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    (line,) = [x for x in r.stderr.splitlines() if str(no_tokenizer) in x]
    assert "model.path" in line and "no tokenizer" in line and "copy the tokenizer files" in line, r.stderr


def test_gguf_and_data_source_through_cli_main(model, tmp_path, capsys):
    gguf = _gguf(tmp_path / "dl" / "x.gguf")
    assert cli.main(["validate", RECIPE, *_base(tmp_path), f"model.path={gguf}"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "model.path = " in err and "is a GGUF file" in err, err
    path = _jsonl(tmp_path / "train.jsonl", _rows({"my_task": 1}))
    assert cli.main(["validate", RECIPE, *_base(tmp_path), f"model.path={model}", f"data.train_files=[{path}]"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "no reward function for data_source 'my_task' (1 row)" in err, err
    # `megarl train` loads the recipe through the same checks, and stops before making its run directory
    assert cli.main(["train", RECIPE, *_base(tmp_path), f"model.path={model}", f"data.train_files=[{path}]"]) == 1
    assert "no reward function for data_source 'my_task'" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_jsonl_rows_count_the_top_level_data_source_only(tmp_path):
    from megarl.reward.checks import data_source_counts

    lines = ['{"data_source": "a", "prompt": "p"}',  # first: read without parsing the row
             ' { "data_source" : "a\\"b" }',
             '{"data_source": "c", "extra_info": {"data_source": "nested"}}',
             '{"prompt": "p", "extra_info": {"data_source": "nested"}}',  # the row has none
             '{"prompt": "p", "data_source": 7}',  # the loader reads it as str()
             '{"prompt": "p"}', '']
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines))
    assert data_source_counts(str(path), "data_source") == {"a": 1, 'a"b': 1, "c": 1, "7": 1}
