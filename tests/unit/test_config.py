"""Recipe loading, overrides and validation: every mistake reported at once, each naming key, value, rule and fix."""
import json
import re
from pathlib import Path

import pytest
import yaml

from megarl.config import ConfigError, write_resolved
from megarl.config.loader import parse_value
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = {"model": {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 2}}}


def _write(tmp_path, name, data):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _issues(exc: ConfigError) -> dict:
    return {i.key: i for i in exc.issues}


def test_five_mistakes_are_all_reported_in_one_run(tmp_path):
    recipe = _write(tmp_path, "bad.yaml", {
        **TINY,
        "rollout": {"temprature": 0.7, "n": 4, "prompt_length": 100, "response_length": 100, "max_model_len": 150},
        "parallelism": {"pipeline_model_parallel_size": 4},
        "trainer": {"n_gpus_per_node": 4},
        "data": {"train_batch_size": 6},
        "actor": {"ppo_mini_batch_size": 4, "loss_agg_mode": "token_mean"},
    })
    with pytest.raises(ConfigError) as err:
        load_config(recipe)
    issues = _issues(err.value)
    assert set(issues) == {"rollout.temprature", "rollout.max_model_len", "parallelism.pipeline_model_parallel_size",
                           "actor.ppo_mini_batch_size", "actor.loss_agg_mode"}, err.value
    assert "rollout.temperature" in issues["rollout.temprature"].fix
    assert "150" in str(err.value) and "200" in str(err.value)  # 100 + 100 vs max_model_len
    assert "num_hidden_layers = 2" in issues["parallelism.pipeline_model_parallel_size"].rule
    assert "token-mean" in issues["actor.loss_agg_mode"].rule  # the closest valid name is suggested
    assert "data.train_batch_size = 6" in issues["actor.ppo_mini_batch_size"].rule
    assert str(err.value).startswith(f"{recipe}: 5 problems")


def test_typo_override_names_the_right_key():
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.temprature=0.7"])
    assert "did you mean 'rollout.temperature'?" in str(err.value)


def test_wrong_type_and_unknown_section_are_reported_with_the_expected_type():
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=many", "rollotu.n=2"])
    issues = _issues(err.value)
    assert "valid integer" in issues["rollout.n"].rule and "expected int" in issues["rollout.n"].fix
    assert "did you mean 'rollout'?" in issues["rollotu"].fix


def test_layout_rules():
    with pytest.raises(ConfigError) as err:
        load_config(data={"model": {"path": "x", "create_tiny": {"architecture": "qwen3_moe", "num_attention_heads": 4,
                                                                  "num_key_value_heads": 2, "num_experts": 6}}},
                    overrides=["parallelism.tensor_model_parallel_size=4", "parallelism.expert_model_parallel_size=4",
                               "trainer.n_gpus_per_node=4", "rollout.n=4"])
    text = str(err.value)
    assert "must divide num_key_value_heads = 2" in text
    assert "must divide the number of experts = 6" in text
    assert "sequence_parallel" in text
    assert "num_attention_heads" not in text  # 4 heads do divide TP=4


def test_world_size_must_be_a_multiple_of_the_model_parallel_size():
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["parallelism.tensor_model_parallel_size=2", "trainer.n_gpus_per_node=3"])
    assert "TP*PP*CP = 2*1*1 = 2" in str(err.value)


def test_micro_batch_must_divide_per_rank_mini_batch():
    # 4 prompts * 4 samples = 16 sequences over DP 2 = 8 per rank; a micro-batch of 3 does not divide 8
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=4", "actor.ppo_mini_batch_size=4", "data.train_batch_size=8",
                                          "trainer.n_gpus_per_node=2", "actor.ppo_micro_batch_size_per_gpu=3"])
    assert "per-rank mini-batch of 8 sequences" in str(err.value)


def test_group_estimator_needs_several_samples():
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=["rollout.n=1", "algorithm.adv_estimator=rloo"])
    assert "rollout.n" in _issues(err.value)


def test_overrides_are_coerced_like_yaml():
    assert parse_value("0.7") == 0.7 and parse_value("true") is True and parse_value("null") is None
    assert parse_value("[1, 2]") == [1, 2] and parse_value("abc") == "abc"
    cfg = load_config(data=TINY, overrides=["rollout.temperature=0.7", "rollout.stop=['</s>']", "trainer.seed=5",
                                            "rollout.max_model_len=null", "rollout.n=2"])
    assert cfg.rollout.temperature == 0.7 and cfg.rollout.stop == ["</s>"] and cfg.trainer.seed == 5


def test_base_recipe_inheritance_and_cycles(tmp_path):
    _write(tmp_path, "base.yaml", {**TINY, "rollout": {"n": 4, "temperature": 0.9}})
    child = _write(tmp_path, "child.yaml", {"base": "base.yaml", "rollout": {"temperature": 0.5}})
    cfg = load_config(child)
    assert cfg.rollout.n == 4 and cfg.rollout.temperature == 0.5
    _write(tmp_path, "a.yaml", {"base": "b.yaml"})
    _write(tmp_path, "b.yaml", {"base": "a.yaml"})
    with pytest.raises(ConfigError, match="cycle"):
        load_config(tmp_path / "a.yaml")


def test_missing_recipe_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")


def test_resolved_config_has_derived_per_rank_batch_sizes(tmp_path):
    cfg = load_config(data=TINY, overrides=[
        "rollout.n=8", "data.train_batch_size=16", "actor.ppo_mini_batch_size=8", "trainer.n_gpus_per_node=4",
        "parallelism.tensor_model_parallel_size=2", "actor.ppo_micro_batch_size_per_gpu=4"])
    path = write_resolved(cfg, tmp_path)
    data = yaml.safe_load(path.read_text())
    d = data["derived"]
    # DP = 4 / 2 = 2; 16 prompts * 8 = 128 sequences, 64 per rank; mini = 8*8/2 = 32 per rank; 32 / 4 = 8 micro
    assert (d["data_parallel_size"], d["sequences_per_step"], d["sequences_per_step_per_rank"]) == (2, 128, 64)
    assert (d["mini_batch_sequences_per_rank"], d["micro_batches_per_mini_batch"], d["mini_batches_per_step"]) == \
        (32, 8, 2)
    assert data["rollout"]["n"] == 8
    again = load_config(data={k: v for k, v in data.items() if k != "derived"})  # the dump loads back unchanged
    assert json.loads(again.model_dump_json()) == json.loads(cfg.model_dump_json())


def test_every_field_has_a_default_and_a_description():
    from pydantic import BaseModel

    from megarl.config import MegarlConfig
    from megarl.config.schema import RolloutConfig

    problems = []

    def walk(cls, prefix=""):
        for name, info in cls.model_fields.items():
            if info.is_required():
                problems.append(f"{prefix}{name}: no default")
            if not info.description:
                problems.append(f"{prefix}{name}: no description")
            for candidate in (info.annotation, *getattr(info.annotation, "__args__", ())):  # Optional[Section] too
                if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                    walk(candidate, f"{prefix}{name}.")
    walk(MegarlConfig)
    assert not problems, problems
    verl_fields = ["name", "temperature", "top_k", "top_p", "do_sample", "n", "repetition_penalty", "over_sample_rate",
                   "prompt_length", "response_length", "dtype", "gpu_memory_utilization", "ignore_eos",
                   "enforce_eager", "free_cache_engine", "data_parallel_size", "expert_model_parallel_size",
                   "tensor_model_parallel_size", "pipeline_model_parallel_size", "max_num_batched_tokens",
                   "max_model_len", "max_num_seqs", "val_kwargs", "log_prob_micro_batch_size_per_gpu", "multi_turn",
                   "enable_chunked_prefill", "enable_prefix_caching", "enable_sleep_mode", "load_format",
                   "quantization", "calculate_log_probs"]
    assert [f for f in verl_fields if f not in RolloutConfig.model_fields] == []


@pytest.mark.parametrize("recipe", sorted(p.name for p in (ROOT / "recipes").glob("*.yaml")))
def test_shipped_recipes_validate(recipe):
    from megarl.validate.paths import PathIssue

    try:
        load_config(ROOT / "recipes" / recipe)
    except ConfigError as exc:  # only inputs that another shipped command writes first (runs/, models/, data/ are not
        # shipped): a megarl command, or a tool of tools/ that exists
        for i in exc.issues:
            assert isinstance(i, PathIssue), exc
            command = re.search(r"first run `([^`]+)`", i.fix)
            assert command, exc
            words = command.group(1).split()
            assert words[0] == "megarl" or (words[0] == "python" and (ROOT / words[1]).is_file()), i.fix
