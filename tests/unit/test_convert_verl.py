"""`megarl convert-verl` on verl's own GSM8K quickstart command lines (fixtures typed from verl's docs): recipes
`megarl validate` accepts, every key mapped, dropped or refused by name; expected values read off verl's docs."""
from pathlib import Path

import pytest
import yaml

from megarl import cli
from megarl.convert_verl import convert
from megarl.convert_verl.convert import HUGE_STEPS
from megarl.convert_verl.inputs import read_inputs, script_overrides
from megarl.validate import load_config

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
    # refused by name: an offload megarl cannot do
    assert "actor_rollout_ref.ref.fsdp_config.param_offload = True: megarl trains with Megatron" in err
    # verl's run length is 15 epochs (no total_training_steps): kept, and total_steps does not cut it short
    assert recipe["trainer"]["total_epochs"] == 15 and recipe["trainer"]["total_steps"] == HUGE_STEPS
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
                 "actor_rollout_ref.actor.peft.peft_type": "ia3",
                 "actor_rollout_ref.actor.fsdp_config.param_offload": True,
                 "actor_rollout_ref.actor.ulysses_sequence_parallel_size": 1})
    refused = {line.split(" = ")[0] for line in c.refused}
    assert refused == {"actor_rollout_ref.rollout.name", "trainer.some_new_knob",
                       "actor_rollout_ref.actor.peft.peft_type", "actor_rollout_ref.actor.fsdp_config.param_offload"}  # True is not mistaken for a size of 1
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


# ----------------------------------------------------------------------------------------------------------------------
# verl's own launch scripts (tests/fixtures/verl/upstream, copied unchanged; see its README)

import random  # noqa: E402

from megarl.config import ConfigError  # noqa: E402
from megarl.convert_verl import gather  # noqa: E402
from megarl.convert_verl.rules import RULES  # noqa: E402

UP = FIXTURES / "upstream"
ENV = {"HOME": "/home/u", "PATH": "/usr/bin"}


def _gathered(script, env=ENV):
    inputs = gather([str(script)], dict(env))
    return inputs, convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer,
                           from_files=inputs.file_keys)


def test_moe_dapo_script_side_by_side_with_verl():
    """run_qwen3moe-30b_megatron_96gb.sh against verl's resolved config: the script's values (read off the script by
    hand) over verl's ppo_megatron_trainer defaults (verl/trainer/config/_generated_ppo_megatron_trainer.yaml)."""
    inputs, c = _gathered(UP / "run_qwen3moe-30b_megatron_96gb.sh", {**ENV, "aime24_test_path": "/d/aime.parquet"})
    assert inputs.trainer == "ppo_megatron_trainer" and not any("$" in str(v) for v in c.mapped)
    cfg = load_config(data=c.recipe)
    verl = {  # verl's resolved setting -> megarl's
        "algorithm.adv_estimator": ("grpo", cfg.algorithm.adv_estimator),
        "data.train_batch_size": (512, cfg.data.train_batch_size),
        "actor.ppo_mini_batch_size": (128, cfg.actor.ppo_mini_batch_size),
        "actor.ppo_micro_batch_size_per_gpu": (2, cfg.actor.ppo_micro_batch_size_per_gpu),
        # verl's token-budget micro-batches at EP8: kept (their count is agreed over the expert-parallel group)
        "actor.use_dynamic_bsz": (True, cfg.actor.use_dynamic_bsz),
        "actor.ppo_max_token_len_per_gpu": (2048 + 8192, cfg.actor.ppo_max_token_len_per_gpu),
        "rollout.n": (16, cfg.rollout.n),
        "data.max_prompt_length": (2048, cfg.rollout.prompt_length),
        "data.max_response_length": (8192, cfg.rollout.response_length),
        "actor.clip_ratio_low": (0.2, cfg.actor.clip_low), "actor.clip_ratio_high": (0.28, cfg.actor.clip_high),
        "actor.clip_ratio_c": (10.0, cfg.actor.clip_ratio_c),
        "actor.use_kl_loss": (False, cfg.actor.use_kl_loss), "algorithm.use_kl_in_reward": (False, cfg.algorithm.use_kl_in_reward),
        "overlong_buffer_cfg.enable": (True, cfg.reward.overlong_buffer.enable),
        "overlong_buffer_cfg.len": (4096, cfg.reward.overlong_buffer.len),
        "overlong_buffer_cfg.penalty_factor": (1.0, cfg.reward.overlong_buffer.penalty_factor),
        "megatron.tensor_model_parallel_size": (1, cfg.parallelism.tensor_model_parallel_size),
        "megatron.pipeline_model_parallel_size": (1, cfg.parallelism.pipeline_model_parallel_size),
        "megatron.expert_model_parallel_size": (8, cfg.parallelism.expert_model_parallel_size),
        "megatron.expert_tensor_parallel_size": (1, cfg.parallelism.expert_tensor_parallel_size),
        "megatron.sequence_parallel (off at TP 1)": (False, cfg.parallelism.sequence_parallel),
        "megatron.use_distributed_optimizer": (True, cfg.parallelism.use_distributed_optimizer),
        "override_transformer_config.moe_router_dtype": ("fp32", cfg.model.moe_router_dtype),
        "rollout.tensor_model_parallel_size": (4, cfg.rollout.tensor_model_parallel_size),
        "actor.optim.lr": (1e-6, cfg.actor.optim.lr), "actor.optim.weight_decay": (0.1, cfg.actor.optim.weight_decay),
        "actor.optim.lr_warmup_steps": (10, cfg.actor.optim.lr_warmup_steps),
        "trainer.total_epochs": (10, cfg.trainer.total_epochs),
        "trainer.n_gpus_per_node": (8, cfg.trainer.n_gpus_per_node), "trainer.nnodes": (1, cfg.trainer.nnodes),
        "data.truncation": ("left", cfg.data.truncation),
        # verl's log-prob forwards: log_prob_use_dynamic_bsz follows actor.use_dynamic_bsz (${oc.select:...})
        "rollout.log_prob_use_dynamic_bsz": (True, cfg.rollout.log_prob_use_dynamic_bsz),
        "rollout.log_prob_max_token_len_per_gpu": (2048 + 8192, cfg.rollout.log_prob_max_token_len_per_gpu),
        "actor.megatron.param_offload": (True, cfg.actor.offload.params),
        "actor.megatron.grad_offload": (True, cfg.actor.offload.grads),
        "actor.megatron.optimizer_offload": (True, cfg.actor.offload.optimizer),
        "ref.megatron.param_offload": (True, cfg.ref.offload),
    }
    assert {k: v[0] for k, v in verl.items()} == {k: v[1] for k, v in verl.items()}
    refused = {line.split(" = ")[0] for line in c.refused}
    assert refused == {  # verl's max_position_embeddings override
        *(f"actor_rollout_ref.actor.optim.override_optimizer_config.{k}" for k in (
            "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d", "use_precision_aware_optimizer",
            "optimizer_cpu_offload")),
        "actor_rollout_ref.model.override_config.model_config.max_position_embeddings"}


def test_an_unset_variable_is_refused_by_name_and_fails_strict(tmp_path, capsys):
    code, recipe, text = _convert_cli(tmp_path, UP / "run_qwen3moe-30b_megatron_96gb.sh", extra=("--strict",))
    err = capsys.readouterr().err
    assert code == 1
    assert "data.val_files = \"['${aime24_test_path}']\": ${aime24_test_path}: not set" in err
    assert "$" not in yaml.safe_dump(recipe)
    code, recipe, _ = _convert_cli(tmp_path, UP / "run_qwen3moe-30b_megatron_96gb.sh",
                                   extra=("--env", "aime24_test_path=/d/aime.parquet"))
    assert recipe["data"]["val_files"] == ["/d/aime.parquet"]


def test_dense_grpo_script_validates_with_verl_megatron_defaults(tmp_path, capsys):
    inputs, c = _gathered(UP / "run_qwen2-7b_math_megatron.sh")
    assert inputs.config_name == "ppo_megatron_trainer.yaml" and inputs.trainer == "ppo_megatron_trainer"
    assert not c.refused
    cfg = load_config(data=c.recipe)
    assert cfg.data.train_files == ["/home/u/data/gsm8k/train.parquet", "/home/u/data/math/train.parquet"]
    assert (cfg.parallelism.tensor_model_parallel_size, cfg.parallelism.pipeline_model_parallel_size) == (2, 2)
    assert cfg.parallelism.sequence_parallel and cfg.parallelism.use_distributed_optimizer  # verl's Megatron defaults
    assert cfg.trainer.total_epochs == 15 and cfg.trainer.device == "cuda"


def test_multi_turn_script_reads_its_config_file_beside_it():
    inputs, c = _gathered(UP / "run_qwen2.5-3b_megatron_gsm8k_multiturn.sh")
    assert inputs.settings["actor_rollout_ref.rollout.multi_turn.enable"] is True  # from config/*.yaml
    assert inputs.settings["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == 5
    assert inputs.settings["data.train_batch_size"] == 1024  # the command line over the file's 256
    assert any(m.startswith("actor_rollout_ref.rollout.multi_turn.max_assistant_turns = 5 -> ") for m in c.mapped)
    refused = " ".join(c.refused)
    # real gaps, named: sglang and verl's tool-config format; its context parallelism (CP 2) maps
    assert "rollout.name = 'sglang'" in refused and "context_parallel_size" not in refused
    assert c.recipe["parallelism"]["context_parallel_size"] == 2
    assert "virtual_pipeline" not in refused  # virtual pipeline stages are carried over
    assert c.recipe["parallelism"]["virtual_pipeline_model_parallel_size"] == 2


def test_arrays_and_ray_submit_script_converts(tmp_path):
    inputs, c = _gathered(UP / "test_dapo_8b_megatron_fp8train.sh")
    assert not inputs.unresolved and not any("\\" in k for k in inputs.settings)
    assert c.recipe["reward"]["overlong_buffer"] == {"enable": True, "len": 4096, "penalty_factor": 1.0}


def test_one_truth_converter_refuses_with_validates_message():
    c = convert({"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2,
                 "data.dataloader_num_workers": 2, "trainer.n_gpus_per_node": 4, "trainer.device": "cpu"})
    with pytest.raises(ConfigError) as exc:
        load_config(data={"parallelism": {"pipeline_model_parallel_size": 2}, "data": {"dataloader_num_workers": 2},
                          "trainer": {"n_gpus_per_node": 4, "device": "cpu"}, "model": {"path": "x"}})
    message = next(i.render() for i in exc.value.issues if i.key.endswith("dataloader_num_workers"))
    line = next(r for r in c.refused if "dataloader_num_workers" in r)
    assert line.endswith(message) and "dataloader_num_workers" not in str(c.recipe)
    with pytest.raises(ConfigError) as left:  # what is left validates, but for the model to fill in
        load_config(data=c.recipe)
    assert [i.key for i in left.value.issues] == ["model.path"]


def test_context_parallelism_maps_once_for_actor_ref_and_critic_and_says_how_sequences_are_cut():
    from megarl.convert_verl.record import report_lines

    ar = "actor_rollout_ref."
    c = convert({ar + "actor.megatron.context_parallel_size": 2, ar + "ref.megatron.context_parallel_size": 2,
                 ar + "actor.megatron.tensor_model_parallel_size": 2, "trainer.n_gpus_per_node": 8})
    assert c.recipe["parallelism"]["context_parallel_size"] == 2 and not c.refused
    lines = [line for line in report_lines(c) if "context_parallel_size" in line]
    # both verl keys are mapped; the first line says how: 2*CP = 4 chunks, rank r holding r and 3-r, rows padded to 4
    assert len(lines) == 2 and "chunks" not in lines[1], lines
    assert "2*CP = 4 load-balanced chunks, CP rank r holding chunks r and 3-r" in lines[0]
    assert "padded to a multiple of 4 tokens" in lines[0] and "token budgets stay per GPU" in lines[0]
    assert load_config(data=c.recipe).parallelism.context_parallel_size == 2  # megarl validate accepts it
    # megarl has one layout for actor, reference and critic: a critic's other CP is refused by name
    c = convert({ar + "actor.megatron.context_parallel_size": 2, "critic.megatron.context_parallel_size": 4})
    assert [r for r in c.refused if r.startswith("critic.megatron.context_parallel_size = 4: megarl has one "
                                                 "parallelism.context_parallel_size (already 2")]
    c = convert({ar + "actor.megatron.context_parallel_size": 1})  # no CP, nothing to say about chunks
    assert [m for m in c.mapped if "context_parallel_size = 1" in m and "chunks" not in m]


_VALUES = ["", "null", "-1", "0", "1e-6", "True", "[1, 2]", "{a: 1}", "abc", "[", "'", "${x.y}", "~/p", "-",
           "[a,b", "1.5", "fp32", "megatron", "None"]


# the default suite runs the first 60 draws of the same random sequence; `make test-slow` all 300
@pytest.mark.parametrize("cases", [60, pytest.param(300, marks=pytest.mark.slow)])
def test_fuzz_malformed_overrides_never_raise(cases):
    rng = random.Random(0)
    keys = sorted(RULES) + ["trainer.nnodes", "actor_rollout_ref.actor.ppo_micro_batch_size", "x", "a.b.c", "=",
                            "actor_rollout_ref.actor.megatron.override_transformer_config.recompute_num_layers"]
    for _ in range(cases):
        items = [f"{rng.choice(keys)}={rng.choice(_VALUES)}" for _ in range(rng.randint(1, 8))]
        items += [rng.choice(["justaword", "=1", "+=2", "~a.b=1"])] if rng.random() < 0.3 else []
        try:
            inputs = gather(items, ENV)
        except ValueError:
            continue  # refused with a message, as the CLI prints it
        c = convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer)
        reported = {line.split(" = ")[0].removeprefix("(verl default) ") for line in c.mapped + c.dropped + c.refused}
        assert set(inputs.settings) - {"custom_reward_function.name"} <= reported | {"custom_reward_function.path"}


def test_validate_suggests_and_checks_model_config_path(tmp_path):
    with pytest.raises(ConfigError, match=r"model.path = .*absent': no such directory.*set model.config_path"):
        load_config(data={"model": {"path": str(tmp_path / "absent")}, "rollout": {"n": 2}})
    config = Path(__file__).resolve().parents[2] / "recipes" / "models" / "llama3_70b" / "config.json"
    cfg = load_config(data={"model": {"path": str(tmp_path / "absent"), "config_path": str(config)},
                            "rollout": {"n": 2}})
    assert [w.key for w in cfg._warnings] == ["model.path"]  # a recipe for another machine: its path is there
    with pytest.raises(ConfigError, match="model.config_path.*file not found"):
        load_config(data={"model": {"path": "x", "config_path": str(tmp_path / "nope.json")}, "rollout": {"n": 2}})


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


def test_megatron_offload_keys_map_to_megarls_offload():
    c = convert({"actor_rollout_ref.actor.megatron.param_offload": True,
                 "actor_rollout_ref.actor.megatron.grad_offload": True,
                 "actor_rollout_ref.actor.megatron.optimizer_offload": True,
                 "actor_rollout_ref.ref.megatron.param_offload": True,
                 "critic.megatron.optimizer_offload": True})
    assert not c.refused
    r = c.recipe
    assert r["actor"]["offload"] == {"params": True, "grads": True, "optimizer": True}
    assert r["ref"]["offload"] is True and r["critic"]["offload"] == {"optimizer": True}
    cfg = load_config(data=r)
    assert cfg.actor.offload.any and cfg.ref.offload and cfg.critic.offload.optimizer and not cfg.critic.offload.params


def test_config_path_flag_wins_over_the_scripts(tmp_path, capsys):
    (tmp_path / "gsm8k_multiturn_megatron_grpo.yaml").write_text(
        "defaults:\n  - ppo_megatron_trainer\n  - _self_\nactor_rollout_ref:\n  rollout:\n    multi_turn:\n"
        "      enable: true\n      max_assistant_turns: 3\n")
    inputs = gather([str(UP / "run_qwen2.5-3b_megatron_gsm8k_multiturn.sh")], dict(ENV), config_path=str(tmp_path))
    assert inputs.settings["actor_rollout_ref.rollout.multi_turn.max_assistant_turns"] == 3
    assert inputs.trainer == "ppo_megatron_trainer"
    missing = gather(["algorithm.adv_estimator=grpo"], dict(ENV), config_path=str(tmp_path), config_name="nope")
    assert [k for k, _, _ in missing.unresolved] == ["--config-name"]  # refused by name, not silently skipped
    code = cli.main(["convert-verl", "--config-name=nope", "--config-path", str(tmp_path), "--strict",
                     "algorithm.adv_estimator=grpo", "--out", str(tmp_path / "r.yaml")])
    assert code == 1 and "--config-name = 'nope': not found in" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["model", "actor.peft"])
def test_lora_keys_map_to_actor_lora(where):
    """verl's LoRA keys, under model (FSDP workers) and under actor.peft (Megatron workers), become actor.lora."""
    ar = "actor_rollout_ref." + where + "."
    settings = {ar + "lora_rank": 16, ar + "lora_alpha": 32, ar + "target_modules": ["q_proj", "v_proj", "k_proj",
                                                                                      "o_proj"]}
    if where == "actor.peft":
        settings[ar + "peft_type"] = "lora"
    c = convert(settings)
    assert not c.refused, c.refused
    lora = c.recipe["actor"]["lora"]
    # verl's LoRA rollout loads the adapters into vLLM (model.lora.merge defaults to false): sync adapter
    assert lora == {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj", "k_proj", "o_proj"],
                    "sync": "adapter"}
    from megarl.config.schema import LoraConfig

    assert LoraConfig.model_validate(lora).enabled


def test_rollout_correction_loss_type_and_preset_map():
    c = convert({"algorithm.rollout_correction.loss_type": "reinforce",
                 "algorithm.rollout_correction.bypass_mode": True, "algorithm.rollout_correction.rollout_is": "token"})
    assert not c.refused
    assert c.recipe["algorithm"]["rollout_correction"]["loss_type"] == "reinforce"
    c = convert({"algorithm.rollout_correction.preset": "decoupled_seq_is"})
    assert c.recipe["algorithm"]["rollout_correction"]["preset"] == "decoupled_seq_is"
