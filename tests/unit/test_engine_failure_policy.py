"""rollout.on_engine_failure: restart by default wherever the trainer starts the engine processes (every trainer
mode: a lost replica's share is generated again, the others' samples kept), fail for Ray-hosted engines; an explicit
restart there is refused by validate."""
import pytest

from megarl.config.issues import ConfigError
from megarl.rollout.checks import check_engine_failure
from megarl.rollout.hosting.supervisor import engine_failure_policy
from megarl.validate import load_config

RECIPE = "recipes/grpo_tiny_cpu.yaml"


def test_the_default_restarts_engine_processes_in_every_mode_and_fails_for_ray():
    assert engine_failure_policy(load_config(RECIPE)) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["trainer.mode=one_step_off_policy"])) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["trainer.mode=async"])) == "restart"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.mode=ray"])) == "fail"
    assert engine_failure_policy(load_config(RECIPE, ["rollout.on_engine_failure=fail"])) == "fail"


def test_an_explicit_restart_of_ray_hosted_engines_is_refused():
    assert check_engine_failure(load_config(RECIPE, ["rollout.on_engine_failure=restart"])) == []
    assert check_engine_failure(load_config(RECIPE, ["rollout.on_engine_failure=restart", "trainer.mode=async"])) == []
    [issue] = check_engine_failure(load_config(RECIPE, ["rollout.mode=ray"]).model_copy(update={"rollout": (
        load_config(RECIPE, ["rollout.mode=ray"]).rollout.model_copy(update={"on_engine_failure": "restart"}))}))
    assert issue.key == "rollout.on_engine_failure" and "rollout.on_engine_failure=fail" in issue.fix
    assert "Ray-hosted" in issue.rule
    with pytest.raises(ConfigError, match="rollout.on_engine_failure = 'restart': Ray-hosted"):
        load_config(RECIPE, ["rollout.on_engine_failure=restart", "rollout.mode=ray"])
