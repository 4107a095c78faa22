"""Validation of rollout.multi_turn: clear errors for settings that cannot work, before any process starts."""
import pytest

from megarl.config import ConfigError
from megarl.validate import load_config

RECIPE = "recipes/multiturn_tool_tiny_cpu.yaml"


def _refused(overrides):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPE, overrides)
    return {i.key: i for i in err.value.issues}


def test_tiny_recipe_is_valid():
    cfg = load_config(RECIPE)
    assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.format == "hermes"


@pytest.mark.parametrize("override", ["rollout.multi_turn.max_user_turns=2", "rollout.multi_turn.sanity_check=true",
                                      "rollout.multi_turn.max_parallel_calls=4"])
def test_settings_need_enable(override):
    key = override.split("=")[0]
    issue = _refused(["rollout.multi_turn.enable=false", override])[key]
    assert "only with rollout.multi_turn.enable=true" in issue.rule


def test_tool_config_is_required_and_checked(tmp_path):
    issue = _refused(["rollout.multi_turn.tool_config_path=null"])["rollout.multi_turn.tool_config_path"]
    assert "tool config file" in issue.rule
    bad = tmp_path / "tools.yaml"
    bad.write_text("tools:\n  - function: nowhere.py:f\n    schema: {type: function, function: {name: f}}\n")
    issue = _refused([f"rollout.multi_turn.tool_config_path={bad}"])["rollout.multi_turn.tool_config_path"]
    assert "tool file not found: 'nowhere.py'" in issue.rule


@pytest.mark.parametrize("override,key,words", [
    ("rollout.multi_turn.format=xml", "rollout.multi_turn.format", "hermes"),
    ("rollout.multi_turn.max_assistant_turns=0", "rollout.multi_turn.max_assistant_turns", "greater than or equal"),
    ("rollout.multi_turn.tool_response_truncate_side=top", "rollout.multi_turn.tool_response_truncate_side", "left"),
    ("algorithm.adv_estimator=remax", "algorithm.adv_estimator", "single-turn"),
    ("rollout.ignore_eos=true", "rollout.ignore_eos", "never end a turn"),
    ("data.synthetic.max_operand=5", "data.synthetic.max_operand", "[32, max_operand]"),
])
def test_bad_values(override, key, words):
    issue = _refused([override])[key]
    assert words in issue.rule or words in issue.render()
