"""`megarl validate` refuses the virtual-pipeline recipes megatron's interleaved schedule would refuse, with the rule."""
import pytest

from megarl.config.issues import ConfigError
from megarl.validate import load_config

KEY = "parallelism.virtual_pipeline_model_parallel_size"


def _cfg(**sections):
    data = {"model": {"path": "x", "create_tiny": {"num_hidden_layers": 4}},  # a model the run would create
            "trainer": {"n_gpus_per_node": 4, "device": "cpu"},
            "parallelism": {"pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2},
            "data": {"train_batch_size": 8}, "rollout": {"n": 2},
            "actor": {"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 1}}
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return data


def _errors(data) -> dict:
    with pytest.raises(ConfigError) as exc:
        load_config(data=data)
    return {i.key: i.render() for i in exc.value.issues if not i.warning}


def test_pp2_vpp2_with_a_micro_batch_count_divisible_by_pp_validates():
    # DP = 4 / 2 = 2; 4 prompts * 2 samples / DP 2 = 4 sequences per rank, micro-batches of 1: 4 = 2 groups of PP
    cfg = load_config(data=_cfg())
    assert cfg.parallelism.virtual_pipeline_model_parallel_size == 2


def test_micro_batch_count_not_a_multiple_of_pp_is_refused_with_the_numbers():
    errors = _errors(_cfg(actor={"ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4}))
    msg = errors["actor.ppo_micro_batch_size_per_gpu"]
    assert "= 1 micro-batches per rank" in msg and "groups of pipeline_model_parallel_size = 2" in msg, msg


def test_critic_micro_batch_count_is_checked_too():
    errors = _errors(_cfg(critic={"enable": True, "ppo_micro_batch_size_per_gpu": 4},
                          algorithm={"adv_estimator": "gae"}))
    assert "critic.ppo_micro_batch_size_per_gpu" in errors


def test_token_budget_updates_are_refused():
    errors = _errors(_cfg(actor={"use_dynamic_bsz": True}))
    assert "changes from step to step" in errors["actor.use_dynamic_bsz"]


def test_layers_must_split_into_pp_times_vpp_chunks(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 6, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 256,
        "max_position_embeddings": 512}))
    errors = _errors(_cfg(model={"path": "x", "config_path": str(tmp_path / "config.json")}))
    assert "PP * virtual PP = 4 must divide num_hidden_layers = 6" in errors["parallelism.pipeline_model_parallel_size"]


def test_vpp_without_pp_is_refused():
    errors = _errors(_cfg(parallelism={"pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": 2},
                          trainer={"n_gpus_per_node": 2, "device": "cpu"}))
    assert KEY in errors


def test_sft_warm_start_micro_batch_count_is_checked():
    # sft.batch_size 2 / DP 2 = 1 row per rank: one micro-batch, not a multiple of PP 2
    errors = _errors(_cfg(sft={"enable": True, "batch_size": 2}))
    assert "= 1 per rank" in errors["sft.batch_size"], errors
    load_config(data=_cfg(sft={"enable": True, "batch_size": 4}))  # 2 rows per rank in micro-batches of 1


def test_routing_replay_and_a_reward_model_are_refused_at_vpp():
    errors = _errors(_cfg(actor={"router_replay": {"mode": "R2"}}))
    assert "virtual pipeline stages" in errors["actor.router_replay.mode"]
    errors = _errors(_cfg(reward={"reward_model": {"enable": True, "path": "x"}}))
    assert "virtual pipeline stages" in errors["reward.reward_model.enable"]
