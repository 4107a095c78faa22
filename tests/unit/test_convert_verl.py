"""`megarl convert-verl` on verl's own GSM8K quickstart command lines (fixtures typed from verl's docs): recipes
`megarl validate` accepts, every key mapped, dropped or refused by name; expected values read off verl's docs."""
from pathlib import Path

import pytest
import yaml

from megarl import cli
from megarl.config import load_config
from megarl.convert_verl import convert, read_inputs, script_overrides

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "verl"
PPO = FIXTURES / "ppo_gsm8k_quickstart.sh"
GRPO = FIXTURES / "grpo_gsm8k_qwen3_8b.sh"


def _convert_cli(tmp_path, *inputs, extra=()) -> tuple[int, dict, str]:
    out = tmp_path / "recipe.yaml"
    code = cli.main(["convert-verl", *map(str, inputs), "--out", str(out), *extra])
    return code, yaml.safe_load(out.read_text()) if out.exists() else {}, out.read_text() if out.exists() else ""


@pytest.mark.parametrize("script", [PPO, GRPO], ids=["ppo", "grpo"])
def test_quickstart_recipes_validate(tmp_path, capsys, script):
    code, _, _ = _convert_cli(tmp_path, script)
    assert code == 0
    assert cli.main(["validate", str(tmp_path / "recipe.yaml")]) == 0, capsys.readouterr().err


def test_every_key_of_the_script_is_accounted_for():
    settings, _ = read_inputs([str(GRPO)])
    assert len(settings) == 37  # the script's overrides; `set -x`, the command, `$@` and the env are not keys
    c = convert(settings)
    reported = [line.split(" = ")[0] for line in c.mapped + c.dropped + c.refused]
    assert sorted(k for k in reported if not k.startswith("(verl default)")) == sorted(settings)


def test_grpo_quickstart_values(tmp_path, capsys):
    code, recipe, text = _convert_cli(tmp_path, GRPO)
    err = capsys.readouterr().err
    assert recipe["algorithm"]["adv_estimator"] == "grpo"
    assert recipe["rollout"]["n"] == 5
    assert recipe["rollout"]["prompt_length"] == 512 and recipe["rollout"]["response_length"] == 1024
    assert recipe["rollout"]["tensor_model_parallel_size"] == 2
    assert recipe["data"]["truncation"] == "filter"  # filter_overlong_prompts=True wins over truncation='error'
    assert recipe["actor"]["use_kl_loss"] is True and recipe["actor"]["kl_loss_coef"] == 0.001
    assert recipe["actor"]["optim"]["lr"] == 1e-6  # '1e-6' is a number, not YAML 1.1 text
    assert recipe["model"]["recompute"] == "full"  # enable_gradient_checkpointing=True
    assert recipe["checkpoint"]["save_freq"] == 20 and recipe["trainer"]["test_freq"] == 5
    assert recipe["logging"]["wandb"] == {"enable": True, "project": "verl_grpo_example_gsm8k",
                                          "name": "qwen3_8b_function_rm"}
    assert "actor_rollout_ref.rollout.n = 5 -> rollout.n = 5" in err
    # refused by name: an offload megarl cannot do, and epochs (megarl counts steps)
    assert "actor_rollout_ref.ref.fsdp_config.param_offload = True: megarl trains with Megatron" in err
    assert "trainer.total_epochs = 15: megarl counts steps" in err
    assert "# REFUSED (not in this recipe): trainer.total_epochs" in text
    # placeholders the user fills in
    assert "model.path = 'Qwen/Qwen3-8B': not a directory here" in err
    assert "actor_rollout_ref.actor.fsdp_config.param_offload = False: no offload" in err


def test_ppo_quickstart_values_and_verl_defaults(tmp_path):
    _, recipe, _ = _convert_cli(tmp_path, PPO)
    assert recipe["algorithm"]["adv_estimator"] == "gae"  # verl's default estimator, not megarl's grpo
    assert recipe["critic"] == {"optim": {"lr": 1e-5}, "model_path": "Qwen/Qwen2.5-0.5B-Instruct",
                                "ppo_micro_batch_size_per_gpu": 4}
    assert recipe["data"]["train_batch_size"] == 256 and recipe["actor"]["ppo_mini_batch_size"] == 64
    assert recipe["trainer"]["n_gpus_per_node"] == 1 and recipe["trainer"]["val_before_train"] is False
    assert recipe["algorithm"]["kl_ctrl"]["kl_coef"] == 0.001
    cfg = load_config(data=recipe)
    assert cfg.critic_enabled and cfg.rollout.log_prob_micro_batch_size_per_gpu == 8


def test_unknown_and_unsupported_keys_are_refused_by_name():
    c = convert({"actor_rollout_ref.rollout.name": "sglang", "trainer.some_new_knob": 3,
                 "actor_rollout_ref.model.lora_rank": 16, "actor_rollout_ref.actor.fsdp_config.param_offload": True,
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1})
    refused = {line.split(" = ")[0] for line in c.refused}
    assert refused == {"actor_rollout_ref.rollout.name", "trainer.some_new_knob", "actor_rollout_ref.model.lora_rank",
                       "actor_rollout_ref.actor.fsdp_config.param_offload"}  # True is not mistaken for a size of 1
    assert any(line.startswith("actor_rollout_ref.actor.ulysses_sequence_parallel_size = 1") for line in c.dropped)


def test_global_micro_batches_become_per_gpu_and_rollout_correction_maps():
    c = convert({"trainer.n_gpus_per_node": 8, "actor_rollout_ref.actor.ppo_micro_batch_size": 128,
                 "actor_rollout_ref.rollout.log_prob_micro_batch_size": 12,
                 "algorithm.rollout_correction.rollout_is": "token",
                 "algorithm.rollout_correction.rollout_is_threshold": 2, "algorithm.rollout_correction.rollout_rs":
                 "sequence", "algorithm.rollout_correction.rollout_rs_threshold": 3.0,
                 "algorithm.rollout_correction.bypass_mode": True, "trainer.save_freq": -1,
                 "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 4})
    r = c.recipe
    assert r["actor"]["ppo_micro_batch_size_per_gpu"] == 16  # 128 over 8 GPUs
    assert r["rollout"]["log_prob_micro_batch_size_per_gpu"] == 2  # ceil(12 / 8)
    assert r["algorithm"]["rollout_correction"] == {"is_level": "token", "is_threshold": 2.0,
                                                    "rejection_level": "sequence", "rejection_threshold": 3.0,
                                                    "use_rollout_log_probs": True}
    assert r["checkpoint"]["save_freq"] == 0  # verl's -1 (never) is megarl's 0
    assert r["parallelism"]["tensor_model_parallel_size"] == 4
    assert not c.refused


def test_yaml_config_and_overrides_agree(tmp_path):
    config = tmp_path / "verl.yaml"
    config.write_text(yaml.safe_dump({"data": {"train_batch_size": 64, "max_prompt_length": 256},
                                      "actor_rollout_ref": {"rollout": {"n": 8, "temperature": 0.7}},
                                      "trainer": {"test_freq": "${trainer.save_freq}"}}))
    from_yaml = convert(read_inputs([str(config), "+actor_rollout_ref.rollout.n=4"])[0])
    from_cli = convert(read_inputs(["data.train_batch_size=64", "data.max_prompt_length=256",
                                    "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=0.7"])[0])
    assert from_yaml.recipe == from_cli.recipe and from_cli.recipe["rollout"]["n"] == 4  # the later input wins
    assert any("a Hydra interpolation" in line for line in from_yaml.dropped)


def test_script_parsing_stops_at_the_pipe():
    text = "A=1 python3 -m verl.trainer.main_ppo \\\n  data.x=1 \\\n  trainer.y='a b' 2>&1 | tee z.log data.no=2"
    assert script_overrides(text) == ["data.x=1", "trainer.y=a b"]


@pytest.mark.parametrize("estimator,loss", [("opo", "sapo"), ("gpg", "gpg"), ("grpo_passk", "clip_cov"),
                                            ("gdpo", "kl_cov"), ("optimal_token_baseline", "geo_mean"),
                                            ("grpo", "dro"), ("grpo", "dppo_tv"), ("grpo", "dppo_kl")])
def test_verl_estimator_and_loss_names_map(estimator, loss):
    ar = "actor_rollout_ref.actor."
    c = convert({"algorithm.adv_estimator": estimator, ar + "policy_loss.loss_mode": loss,
                 ar + "policy_loss.clip_cov_ratio": 0.0002, ar + "policy_loss.kl_cov_ratio": 0.0002,
                 ar + "policy_loss.ppo_kl_coef": 0.1, ar + "tau_pos": 1.0, ar + "tau_neg": 1.05,
                 ar + "policy_loss.dro_beta": 0.5 if loss == "dro" else None,
                 "actor_rollout_ref.rollout.n": 4})
    assert not c.refused
    assert c.recipe["algorithm"]["adv_estimator"] == estimator and c.recipe["actor"]["policy_loss"] == loss
    options = c.recipe["actor"]["policy_loss_options"]
    assert options["tau_neg"] == 1.05 and options["kl_cov_ratio"] == 0.0002
    assert load_config(data={**c.recipe, "model": {"path": "unused"}}) is not None


def test_rollout_correction_loss_type_and_preset_map():
    c = convert({"algorithm.rollout_correction.loss_type": "reinforce",
                 "algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.rollout_is": "token"})
    assert not c.refused
    assert c.recipe["algorithm"]["rollout_correction"]["loss_type"] == "reinforce"
    c = convert({"algorithm.rollout_correction.preset": "decoupled_seq_is"})
    assert c.recipe["algorithm"]["rollout_correction"]["preset"] == "decoupled_seq_is"
