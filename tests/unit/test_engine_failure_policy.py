"""rollout.on_engine_failure: restart by default for every placement (engine processes the trainer starts, Ray-hosted
replicas) and every trainer mode; fail when the recipe says so."""
import pytest

from megarl.config.issues import ConfigError
from megarl.rollout.hosting.supervisor import engine_failure_policy
from megarl.validate import load_config

RECIPE = "recipes/grpo_tiny_cpu.yaml"


def test_the_default_restarts_everywhere_and_fail_is_kept():
    assert engine_failure_policy(load_config(RECIPE)) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["trainer.mode=one_step_off_policy"])) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["trainer.mode=async"])) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.mode=ray"])) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.on_engine_failure=fail"])) == "fail"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.on_engine_failure=restart", "rollout.mode=ray"])) \
        == "restart"


def test_an_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match="on_engine_failure"):
        load_config(RECIPE, ["rollout.on_engine_failure=retry"])
