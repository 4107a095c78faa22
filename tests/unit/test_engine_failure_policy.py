"""rollout.on_engine_failure: restart by default where a restart keeps the step's batch exact (sync mode, engine
processes the trainer starts), fail elsewhere; an explicit restart where it cannot be kept is refused by validate."""
import pytest

from megarl.config.issues import ConfigError
from megarl.rollout.checks import check_engine_failure
from megarl.rollout.hosting.supervisor import engine_failure_policy
from megarl.validate import load_config

RECIPE = "recipes/grpo_tiny_cpu.yaml"


def test_the_default_restarts_in_sync_mode_and_fails_where_restarts_are_not_supported():
    assert engine_failure_policy(load_config(RECIPE)) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["trainer.mode=one_step_off_policy"])) == "fail"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.mode=ray"])) == "fail"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.on_engine_failure=fail"])) == "fail"


def test_an_explicit_restart_where_the_batch_could_not_stay_exact_is_refused():
    assert check_engine_failure(load_config(RECIPE, ["rollout.on_engine_failure=restart"])) == []
    [issue] = check_engine_failure(load_config(RECIPE, ["trainer.mode=async"]).model_copy(update={"rollout": (
        load_config(RECIPE).rollout.model_copy(update={"on_engine_failure": "restart"}))}))
    assert issue.key == "rollout.on_engine_failure" and "rollout.on_engine_failure=fail" in issue.fix
    assert "older weights" in issue.rule
    with pytest.raises(ConfigError, match="rollout.on_engine_failure = 'restart': trainer.mode=async"):
        load_config(RECIPE, ["rollout.on_engine_failure=restart", "trainer.mode=async"])
