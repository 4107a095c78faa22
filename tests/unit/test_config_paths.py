"""`megarl validate` checks every path a recipe names before anything starts: a missing input is refused in one line
with the key, the value and the fix, naming the megarl command that writes it where there is one; what the run makes
itself before reading it is not an error."""
import os
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError
from megarl.validate import load_config
from megarl.validate.paths import PathIssue

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"


def _base(tmp_path) -> list:
    # the demo recipe with its generated inputs (tiny model, synthetic data, SFT model) under tmp_path
    return [f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'init'}", "sft.output_dir=null"]


def _refusal(overrides: list, key: str) -> PathIssue:
    with pytest.raises(ConfigError) as exc:
        load_config(RECIPE, overrides)
    mine = [i for i in exc.value.issues if i.key == key]
    assert len(mine) == 1, exc.value
    return mine[0]


def test_what_the_run_makes_before_reading_it_is_not_refused(tmp_path):
    made = _base(tmp_path) + [
        "sft.enable=true", "algorithm.adv_estimator=gae", f"critic.model_path={tmp_path / 'run' / 'sft_model'}",
        "distillation.enable=true", f"distillation.teacher.path={tmp_path / 'init'}",
        f"data.train_files=[{tmp_path / 'run' / 'data' / 'train.parquet'}]"]
    cfg = load_config(RECIPE, made)
    assert not any(isinstance(w, PathIssue) for w in cfg._warnings)


# (override with a missing path, key, what the fix says)
CASES = [
    ("model.path={t}/nomodel", "model.path", "huggingface-cli download"),
    ("model.tokenizer_path={t}/notok", "model.tokenizer_path", "tokenizer directory"),
    ("critic.model_path={t}/nocritic", "critic.model_path", "unset it"),
    ("distillation.teacher.path={t}/noteacher", "distillation.teacher.path", "megarl merge"),
    ("reward.reward_model.path={t}/norm", "reward.reward_model.path", "megarl rm RECIPE"),
    ("reward.judge.path={t}/nojudge", "reward.judge.path", "huggingface-cli download"),
    ("rm.model_path={t}/nobase", "rm.model_path", "unset it"),
    ("data.train_files=[{t}/no.parquet]", "data.train_files[0]", ".parquet or .jsonl"),
    ("data.val_files=[{t}/no.jsonl]", "data.val_files[0]", ".parquet or .jsonl"),
    ("sft.train_files=[{t}/no.parquet]", "sft.train_files[0]", "prompt/response"),
    ("rm.train_files=[{t}/no.parquet]", "rm.train_files[0]", "preference pairs"),
    ("rm.val_files=[{t}/no.parquet]", "rm.val_files[0]", "preference pairs"),
    ("rollout.multi_turn.tool_config_path={t}/no.yaml", "rollout.multi_turn.tool_config_path", "'tools:' list"),
    ("checkpoint.resume={t}/norun", "checkpoint.resume", "megarl import"),
    ("model.config_path={t}/no.json", "model.config_path", "config.json"),
    ("reward.reward_fn={t}/no.py:score", "reward.reward_fn", "fix the path"),
]
ENABLE = {"critic.model_path": ["algorithm.adv_estimator=gae"], "distillation.teacher.path": ["distillation.enable=true"],
          "reward.reward_model.path": ["reward.reward_model.enable=true"],
          "reward.judge.path": ["reward.judge.enable=true", "reward.judge.parser=number"],
          "rollout.multi_turn.tool_config_path": ["rollout.multi_turn.enable=true"]}


@pytest.mark.parametrize("override,key,fix", CASES, ids=[c[1] for c in CASES])
def test_a_missing_path_is_refused_with_key_value_and_fix(tmp_path, override, key, fix):
    override = override.format(t=tmp_path)
    value = yaml.safe_load(override.split("=", 1)[1])
    value = value[0] if isinstance(value, list) else value
    extra = ["model.create_tiny=null"] if key == "model.path" else []
    issue = _refusal(_base(tmp_path) + extra + ENABLE.get(key, []) + [override], key)
    line = issue.render()
    assert "\n" not in line and line.startswith(f"{key} = {value!r}: "), line
    assert "not found" in line or "no such" in line, line
    assert fix in line, line


def test_a_file_in_place_of_an_output_directory(tmp_path):
    (tmp_path / "taken").write_text("")
    issue = _refusal(_base(tmp_path) + [f"rm.output_dir={tmp_path / 'taken'}"], "rm.output_dir")
    assert "is a file; megarl writes a directory there" in issue.render()


def test_recipes_for_another_machine_get_warnings(tmp_path):
    config = ROOT / "recipes" / "models" / "llama3_70b" / "config.json"
    cfg = load_config(ROOT / "recipes" / "ppo_llama3_70b.yaml", [f"model.config_path={config}",
                                                                  f"data.train_files=[{tmp_path}/x.parquet]"])
    warned = {w.key for w in cfg._warnings if isinstance(w, PathIssue)}
    assert {"model.path", "data.train_files[0]"} <= warned


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data))


def test_the_command_that_writes_a_missing_input_is_named(tmp_path, monkeypatch):
    """A reward model another recipe trains: `megarl rm that-recipe`; once written it validates; damaged, the same
    command is named to make it again."""
    from tests.helpers.tiny_models import make_tiny_model

    monkeypatch.chdir(tmp_path)
    base = {"model": {"path": "runs/init", "create_tiny": {}}, "data": {"synthetic": {}}, "rollout": {"n": 2}}
    _write(tmp_path / "recipes" / "rm_first.yaml", {**base, "trainer": {"run_dir": "runs/rm_run"}})
    _write(tmp_path / "recipes" / "ppo_rm.yaml", {**base, "trainer": {"run_dir": "runs/ppo"},
                                                 "reward": {"reward_model": {"enable": True,
                                                                             "path": "runs/rm_run/rm_model"}}})
    issue = _refusal_of("recipes/ppo_rm.yaml", "reward.reward_model.path")
    assert issue.render() == (f"reward.reward_model.path = 'runs/rm_run/rm_model': no such directory (relative paths "
                              f"start at {os.getcwd()}), and this run does not create it -> first run `megarl rm "
                              "recipes/rm_first.yaml`, which writes it; or fix the path")
    rm = make_tiny_model("qwen2", tmp_path / "runs" / "rm_run" / "rm_model", head="value")  # as `megarl rm` writes
    load_config("recipes/ppo_rm.yaml")
    (rm / "config.json").write_text("{")
    issue = _refusal_of("recipes/ppo_rm.yaml", "reward.reward_model.path")
    assert issue.render().endswith("-> delete the directory and run `megarl rm recipes/rm_first.yaml` again")


def _refusal_of(recipe: str, key: str) -> PathIssue:
    with pytest.raises(ConfigError) as exc:
        load_config(recipe)
    (issue,) = [i for i in exc.value.issues if i.key == key]
    return issue


@pytest.mark.parametrize("recipe,key,command", [
    ("ppo_rm_tiny_cpu.yaml", "reward.reward_model.path", "`megarl rm recipes/rm_tiny_cpu.yaml`"),
    ("distill_tiny_cpu.yaml", "distillation.teacher.path", "`megarl train recipes/grpo_tiny_cpu.yaml` then `megarl "
     "merge --ckpt runs/grpo_tiny_cpu/checkpoints/step_150 --out runs/grpo_tiny_cpu/teacher`")])
def test_shipped_recipes_name_the_recipe_that_writes_their_input(recipe, key, command, monkeypatch):
    monkeypatch.chdir(ROOT)
    data = yaml.safe_load((ROOT / "recipes" / recipe).read_text())
    path = data["reward"]["reward_model"]["path"] if key.startswith("reward") else data["distillation"]["teacher"]["path"]
    if Path(path).exists():
        pytest.skip(f"{path} was made on this machine")
    assert f"first run {command}, which writes it" in _refusal_of(f"recipes/{recipe}", key).fix
