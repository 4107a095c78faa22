"""The rules table: each verl key (or family of keys) -> what megarl does with it.

`rule_for(key)` is the key's own rule in RULES, else its family's (optimizers, Megatron layouts and switches, FSDP
settings, validation sampling), else None: megarl has no equivalent and the key is refused. The kinds of rule are in
megarl.convert_verl.rule_kinds.
"""
from __future__ import annotations

from typing import Optional

from megarl.convert_verl.rule_kinds import (Rule, accept, context_parallel, decided_later, files, filter_overlong,
                                            freq, level, load_format, logger, lora_merge, lr_schedule,
                                            megatron_dtype, no_effect, off_only, policy_loss, recompute,
                                            recompute_detail, recompute_granularity, refuse, resume_mode,
                                            reward_manager, rollout_name, router_dtype, rs_threshold, steps_or_unset,
                                            to, truncation)
from megarl.convert_verl.verl_behaviour import AR

_OPTIM = ("lr", "weight_decay", "betas", "eps", "clip_grad", "min_lr")
_TRANSFORMER = "override_transformer_config."  # verl's prefix for megatron TransformerConfig fields
_OFFLOAD = ("megarl trains with Megatron; its offload around rollout is the megatron keys (param_offload, "
            "grad_offload, optimizer_offload -> actor/critic.offload.*, ref.offload); check the memory with "
            "`megarl plan`")
# verl's Megatron offload keys -> megarl's (the reference has parameters only)
_MEGATRON_OFFLOAD = {"param_offload": "params", "grad_offload": "grads", "optimizer_offload": "optimizer"}
_NO_PADDING_SWITCH = ("megarl always removes padding: every micro-batch runs packed (rows end to end with their "
                      "boundaries, no padding computed), which is what use_remove_padding=true asks; there is no switch")
_FSDP = "an FSDP setting; megarl trains with Megatron (set parallelism.* instead)"
_PARALLEL = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size",
             "context_parallel_size", "expert_model_parallel_size", "expert_tensor_parallel_size", "sequence_parallel",
             "use_distributed_optimizer", "num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage")

RULES: dict[str, Rule] = {
    # data
    "data.train_files": to("data.train_files", files),
    "data.val_files": to("data.val_files", files),
    "data.max_prompt_length": to("rollout.prompt_length"),
    "data.max_response_length": to("rollout.response_length"),
    "data.reward_fn_key": to("data.data_source_key"),
    "data.seed": to("trainer.seed"),
    "data.truncation": truncation,
    "data.filter_overlong_prompts": filter_overlong,
    "data.filter_overlong_prompts_workers": no_effect("megarl filters prompts in the loading process"),
    "data.return_raw_chat": no_effect("megarl renders the chat template itself (data.apply_chat_template)"),
    "data.return_raw_input_ids": no_effect("megarl renders the chat template itself (data.apply_chat_template)"),
    "data.tokenizer": to("model.tokenizer_path"),
    # model
    AR + "model.path": to("model.path"),
    AR + "model.tokenizer_path": to("model.tokenizer_path"),
    AR + "model.trust_remote_code": to("model.trust_remote_code"),
    AR + "model.enable_gradient_checkpointing": recompute,
    AR + "model.use_remove_padding": no_effect(_NO_PADDING_SWITCH),
    # LoRA: verl's keys under model (FSDP workers) and under actor.peft (Megatron workers) -> actor.lora
    AR + "model.lora_rank": to("actor.lora.rank"),
    AR + "model.lora_alpha": to("actor.lora.alpha"),
    AR + "model.target_modules": to("actor.lora.target_modules"),
    # verl's newer model.lora.* section (Megatron workers); its target_modules use Megatron's layer names, which
    # megarl's HF/PEFT names do not take, so that one stays refused
    AR + "model.lora.rank": to("actor.lora.rank"),
    AR + "model.lora.alpha": to("actor.lora.alpha"),
    AR + "model.lora.dropout": to("actor.lora.dropout"),
    AR + "actor.peft.lora_rank": to("actor.lora.rank"),
    AR + "actor.peft.lora_alpha": to("actor.lora.alpha"),
    AR + "actor.peft.target_modules": to("actor.lora.target_modules"),
    AR + "actor.peft.peft_type": accept(("lora", "LORA", None), "megarl's actor.lora is LoRA",
                                        "megarl implements LoRA adapters only (peft_type: lora)"),
    # verl's LoRA rollout: adapters into vLLM's LoRA support (TensorLoRARequest) unless model.lora.merge merges them
    AR + "model.lora.merge": lora_merge,
    AR + "rollout.layered_summon": no_effect("verl gathers FSDP-sharded weights layer by layer to save memory; megarl "
                                             "gathers only the adapters (actor.lora.sync=adapter) or merges each "
                                             "rank's own shards (merged), never the whole model"),
    AR + "model.use_shm": off_only("off", "megarl reads the model from model.path; drop it"),
    # actor
    AR + "actor.grad_clip": to("actor.optim.clip_grad"),
    AR + "actor.policy_loss.loss_mode": policy_loss,
    AR + "actor.strategy": accept(("megatron",), "megarl's trainer is Megatron", "megarl trains with Megatron "
                                  "whatever verl's strategy was; drop it (set parallelism.* for the layout)"),
    AR + "actor.ulysses_sequence_parallel_size": off_only("no sequence parallelism over heads",
                                                          "Ulysses sequence parallelism is not supported; use "
                                                          "parallelism.tensor_model_parallel_size",
                                                          off=(None, 0, 1)),
    # rollout
    AR + "rollout.name": rollout_name,
    AR + "rollout.mode": no_effect("megarl's engine serves every request of a step together"),
    AR + "rollout.expert_parallel_size": to("rollout.expert_model_parallel_size"),
    AR + "rollout.load_format": load_format,
    AR + "rollout.quantization": to("rollout.quantization"),
    AR + "rollout.checkpoint_engine.update_weights_bucket_megabytes": to("rollout.update_weights_bucket_megabytes"),
    AR + "rollout.multi_turn.enable": to("rollout.multi_turn.enable"),
    AR + "rollout.micro_batch_size": no_effect("deprecated in verl and unused"),
    AR + "rollout.prompt_length": no_effect("verl derives it from data.max_prompt_length (rollout.prompt_length)"),
    AR + "rollout.response_length": no_effect("verl derives it from data.max_response_length "
                                              "(rollout.response_length)"),
    # reference
    AR + "ref.log_prob_micro_batch_size_per_gpu": to("ref.log_prob_micro_batch_size_per_gpu"),
    # critic
    "critic.model.path": to("critic.model_path"),
    "critic.grad_clip": to("critic.optim.clip_grad"),
    "critic.model.enable_gradient_checkpointing": recompute,
    "critic.model.use_remove_padding": no_effect(_NO_PADDING_SWITCH),
    "critic.model.trust_remote_code": to("model.trust_remote_code"),
    "critic.ppo_mini_batch_size": no_effect("megarl's critic uses the actor's mini-batches "
                                            "(actor.ppo_mini_batch_size)"),
    # reward
    "reward_model.enable": to("reward.reward_model.enable"),
    "reward_model.model.path": to("reward.reward_model.path"),
    "reward_model.micro_batch_size_per_gpu": to("reward.reward_model.micro_batch_size_per_gpu"),
    "reward_model.max_length": to("reward.reward_model.max_length"),
    "reward_model.reward_manager": reward_manager,
    # algorithm
    "algorithm.rollout_correction.bypass_mode": to("algorithm.rollout_correction.use_rollout_log_probs"),
    "algorithm.rollout_correction.rollout_is": level("algorithm.rollout_correction.is_level", ("token", "sequence")),
    "algorithm.rollout_correction.rollout_is_threshold": to("algorithm.rollout_correction.is_threshold", float),
    "algorithm.rollout_correction.rollout_rs": level("algorithm.rollout_correction.rejection_level",
                                                     ("token", "sequence", "geometric", "seq_mean_k3")),
    "algorithm.rollout_correction.preset": to("algorithm.rollout_correction.preset"),
    "algorithm.rollout_correction.rollout_rs_threshold": rs_threshold,
    "algorithm.rollout_correction.rollout_rs_threshold_lower": off_only(
        "unset: the lower bound is 1/threshold", "megarl's lower bound is 1/rollout_rs_threshold; drop it"),
    "algorithm.rollout_correction.rollout_is_batch_normalize": off_only(
        "off", "batch-normalised importance weights are not supported; drop it"),
    "algorithm.rollout_correction.rollout_token_veto_threshold": off_only(
        "off", "a token veto is not supported; use rollout_rs=token with rollout_rs_threshold"),
    "algorithm.rollout_correction.loss_type": to("algorithm.rollout_correction.loss_type"),
    "algorithm.rollout_correction.use_policy_gradient": off_only("off", "megarl's correction reweights "
                                                                 "actor.policy_loss; drop it"),
    # trainer
    "trainer.save_freq": freq("checkpoint.save_freq"),
    "trainer.test_freq": freq("trainer.test_freq"),
    "trainer.critic_warmup": to("critic.warmup_steps"),
    "trainer.logger": logger,
    "trainer.project_name": to("logging.wandb.project"),
    "trainer.experiment_name": to("logging.wandb.name"),
    "trainer.default_local_dir": to("trainer.run_dir"),
    "trainer.default_hdfs_dir": off_only("unset", "megarl writes checkpoints to trainer.run_dir only; copy them "
                                         "to HDFS yourself"),
    "trainer.resume_mode": resume_mode,
    "trainer.resume_from_path": to("checkpoint.resume"),
    "trainer.max_actor_ckpt_to_keep": to("checkpoint.keep_last_k"),
    "trainer.max_critic_ckpt_to_keep": to("checkpoint.keep_last_k"),  # one count for actor and critic together
    "trainer.balance_batch": no_effect("a throughput option; megarl has no equivalent and results do not depend "
                                       "on it"),
    "trainer.log_val_generations": to("trainer.log_val_generations"),
    "trainer.total_epochs": to("trainer.total_epochs"),
    "trainer.total_training_steps": steps_or_unset("trainer.total_steps", "unset: the run length comes from "
                                                   "trainer.total_epochs"),
    "data.trust_remote_code": to("model.trust_remote_code"),
    "data.gen_batch_size": decided_later("rollout.over_sample_rate"),
    AR + "hybrid_engine": accept((True,), "megarl's engines always receive the actor's weights after each update",
                                 "megarl's rollout always uses the actor's latest weights; drop it"),
    AR + "nccl_timeout": no_effect("a collective-communication timeout; megarl keeps torch.distributed's default"),
    AR + "model.use_fused_kernels": no_effect("verl's fused log-prob/entropy kernel saves memory; the values are the "
                                              "same, and megarl computes log-probs from vocab-parallel logits itself"),
    AR + "model.override_config.model_config.max_position_embeddings": refuse(
        "megarl reads the model's config.json as it is; raise max_position_embeddings there if you need to"),
    AR + "ref.log_prob_use_dynamic_bsz": to("rollout.log_prob_use_dynamic_bsz"),
    AR + "ref.log_prob_max_token_len_per_gpu": to("rollout.log_prob_max_token_len_per_gpu"),
    AR + "ref.strategy": accept(("megatron",), "megarl's trainer is Megatron", "megarl computes the reference with "
                                "Megatron whatever verl's strategy was; drop it"),
    "critic.strategy": accept(("megatron",), "megarl's trainer is Megatron", "megarl trains the critic with "
                              "Megatron whatever verl's strategy was; drop it"),
    "reward_model.reward_kwargs.max_resp_len": decided_later(),
    "reward.reward_kwargs.max_resp_len": decided_later(),
    "reward.reward_manager.name": reward_manager,
}
for _prefix in ("reward_model.reward_kwargs.overlong_buffer_cfg.", "reward.reward_kwargs.overlong_buffer_cfg."):
    RULES.update({_prefix + name: to("reward.overlong_buffer." + name) for name in ("enable", "len",
                                                                                    "penalty_factor")})
    RULES[_prefix + "log"] = no_effect("a logging switch of verl's DAPO reward manager; it changes no reward")
RULES["reward_model.overlong_buffer.log"] = RULES["reward_model.reward_kwargs.overlong_buffer_cfg.log"]
_MULTI_TURN = AR + "rollout.multi_turn."
RULES.update({_MULTI_TURN + name: to("rollout.multi_turn." + name) for name in (
    "max_assistant_turns", "max_user_turns", "max_parallel_calls", "max_tool_response_length",
    "tool_response_truncate_side", "tool_config_path", "format")})
RULES.update({
    _MULTI_TURN + "interaction_config_path": off_only("unset", "simulated-user interactions are not supported by "
                                                      "megarl; drop it"),
    _MULTI_TURN + "use_inference_chat_template": off_only("off", "megarl renders every turn with the training chat "
                                                          "template; drop it"),
    _MULTI_TURN + "tokenization_sanity_check_mode": no_effect(
        "megarl builds the trajectory from the engine's own tokens; rollout.multi_turn.sanity_check counts drift"),
    _MULTI_TURN + "num_repeat_rollouts": off_only("unset", "megarl samples rollout.n responses per prompt; drop it"),
})


# verl keys whose megarl key has the same name under the given section: {verl prefix: (megarl prefix, names)}
_SAME_NAMES = {
    "data.": ("data.", (
        "train_batch_size", "val_batch_size", "prompt_key", "shuffle", "dataloader_num_workers")),
    AR + "actor.": ("actor.", (
        "ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "use_dynamic_bsz", "ppo_max_token_len_per_gpu",
        "ppo_epochs", "shuffle", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
        "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")),
    AR + "rollout.": ("rollout.", (
        "n", "temperature", "top_p", "top_k", "do_sample", "ignore_eos", "dtype", "gpu_memory_utilization",
        "tensor_model_parallel_size", "data_parallel_size", "pipeline_model_parallel_size", "enforce_eager",
        "free_cache_engine", "enable_chunked_prefill", "enable_prefix_caching", "max_num_batched_tokens",
        "max_num_seqs", "max_model_len", "calculate_log_probs", "log_prob_micro_batch_size_per_gpu",
        "log_prob_use_dynamic_bsz", "log_prob_max_token_len_per_gpu", "update_weights_bucket_megabytes")),
    "critic.": ("critic.", (
        "enable", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "cliprange_value", "loss_agg_mode")),
    "reward_model.overlong_buffer.": ("reward.overlong_buffer.", (
        "enable", "len", "penalty_factor")),
    AR + "actor.policy_loss.": ("actor.policy_loss_options.", (
        "clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef", "dro_beta")),
    "algorithm.": ("algorithm.", (
        "adv_estimator", "gamma", "lam", "norm_adv_by_std_in_grpo", "use_kl_in_reward", "kl_penalty",
        "gdpo_reward_keys", "gdpo_reward_weights")),
    "algorithm.kl_ctrl.": ("algorithm.kl_ctrl.", (
        "type", "kl_coef", "target_kl", "horizon")),
    "algorithm.filter_groups.": ("algorithm.filter_groups.", (
        "enable", "metric", "max_num_gen_batches")),
    "trainer.": ("trainer.", (
        "val_before_train", "n_gpus_per_node", "nnodes", "device")),
}
RULES.update({verl + name: to(megarl + name) for verl, (megarl, names) in _SAME_NAMES.items() for name in names})
RULES.update({AR + f"actor.{name}": to(f"actor.policy_loss_options.{name}") for name in ("tau_pos", "tau_neg")})


_FUSIONS = ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion", "bias_dropout_fusion",
            "gradient_accumulation_fusion", "persist_layer_norm", "moe_permute_fusion", "cross_entropy_loss_fusion")


def _transformer_override(name: str) -> Optional[Rule]:
    """verl's +override_transformer_config.* (megatron TransformerConfig fields)."""
    if name in _FUSIONS:
        return no_effect("a kernel-fusion switch (the same math); megarl builds its layers with these fusions off")
    if name == "moe_grouped_gemm":
        return no_effect("megarl uses grouped-GEMM experts whenever it uses Transformer Engine")
    if name in ("moe_token_dispatcher_type", "moe_enable_deepep", "moe_shared_expert_overlap"):
        return no_effect("how tokens travel to their experts (communication, the same results); megarl uses "
                         "megatron's allgather dispatcher")
    if name in ("deallocate_pipeline_outputs", "attention_backend", "use_flash_attn"):
        return no_effect("a memory/kernel choice with the same results; megarl leaves it to megatron")
    if name == "recompute_granularity":
        return recompute_granularity
    if name == "recompute_method":
        return recompute_detail((None, "uniform"), "full recomputation is uniform")
    if name == "recompute_num_layers":
        return recompute_detail((None, 1), "full recomputation takes 1-layer chunks")
    if name == "recompute_modules":
        return recompute_detail((None, ["core_attn"]), "selective recomputation is the attention core")
    if name == "moe_router_dtype":
        return router_dtype
    return None



def _optim_rule(role: str, name: str) -> Optional[Rule]:
    """actor/critic.optim.*: the optimizer and its learning-rate schedule."""
    target = f"{role}.optim."
    if name in _OPTIM:
        return to(target + name)
    if name in ("warmup_style", "lr_scheduler_type", "lr_decay_style"):
        return lr_schedule(target + "lr_decay_style")
    if name == "lr_warmup_steps":
        return steps_or_unset(target + name, "verl's -1: the warm-up comes from lr_warmup_steps_ratio")
    if name in ("lr_decay_steps", "use_checkpoint_opt_param_scheduler", "lr_wsd_decay_steps"):
        return off_only("unset: the schedule spans the run", "megarl's schedule decays over the whole run; "
                        "drop it")
    if name in ("weight_decay_incr_style", "lr_wsd_decay_style"):
        return accept(("constant", "exponential") if "wsd" in name else ("constant",), "megarl's default",
                      "megarl keeps the weight decay constant; drop it")
    if name == "optimizer":
        return accept(("adam", "adamw", "AdamW"), "megarl's optimizer is Adam with decoupled weight decay",
                      "megarl's optimizer is Adam (AdamW); drop it")
    if name in ("lr_warmup_steps_ratio", "min_lr_ratio", "total_training_steps", "lr_warmup_init"):
        return off_only("unset", f"give the warm-up in steps ({target}lr_warmup_steps) and the final rate "
                                 f"as a value ({target}min_lr)")
    return None


def _megatron_rule(role: str, name: str) -> Optional[Rule]:
    """actor/ref/critic.megatron.*: the parallel layout, offload, routing replay and megatron's own switches."""
    if name.removeprefix(_TRANSFORMER) in _PARALLEL[-2:]:  # verl's uneven-stage settings
        name = name.removeprefix(_TRANSFORMER)
    if name == "context_parallel_size":
        return context_parallel
    if name in _PARALLEL:
        return to(f"parallelism.{name}")
    if name == "router_replay.mode" and role == "actor":  # verl's "disabled" is megarl's "none"
        return to("actor.router_replay.mode", lambda v: "none" if v in ("disabled", "none") else v)
    if name.startswith("router_replay."):  # verl's record/replay file paths and the ref's own copy of the mode
        return no_effect("megarl's routing replay is actor.router_replay.mode alone; routes stay in memory")
    if name in _MEGATRON_OFFLOAD and role == "ref":
        return to("ref.offload") if name == "param_offload" else no_effect("the reference has no gradients "
                                                                            "or optimizer states")
    if name in _MEGATRON_OFFLOAD:
        return to(f"{role}.offload.{_MEGATRON_OFFLOAD[name]}")
    if "offload" in name:
        return off_only("no offload", _OFFLOAD)
    if name.startswith(_TRANSFORMER):
        return _transformer_override(name.removeprefix(_TRANSFORMER))
    return _MEGATRON_SWITCHES.get(name)


_MEGATRON_SWITCHES: dict[str, Rule] = {
    "seed": no_effect("megarl seeds everything from trainer.seed"),
    **dict.fromkeys(("use_mbridge", "vanilla_mbridge"), no_effect(
        "megarl converts Hugging Face weights to Megatron and back itself (megarl.bridge)")),
    "use_remove_padding": no_effect(_NO_PADDING_SWITCH),
    **dict.fromkeys(("forward_only", "dist_checkpointing_prefix"), no_effect("internal to verl's Megatron workers")),
    **dict.fromkeys(("use_dist_checkpointing", "dist_checkpointing_path"), off_only(
        "off: the initial weights come from the Hugging Face model", "megarl loads the initial weights from the "
        "Hugging Face directory in model.path; drop it and point model.path at the Hugging Face model")),
    "dtype": megatron_dtype,
}


def _other_family_rule(key: str, short: str, rest: str) -> Optional[Rule]:
    """FSDP settings, validation sampling and verl's speed-only switches, under any role."""
    if ".fsdp_config." in f".{rest}":
        return off_only("no offload (an FSDP setting)", _OFFLOAD) if "offload" in key else no_effect(_FSDP)
    if short == "rollout.enable_rollout_routing_replay":  # verl's engine half of R3: megarl's mode R3 asks for it
        return no_effect("megarl derives it from actor.router_replay.mode (R3 is the mode that needs the "
                         "engine's routes)")
    if short.startswith("rollout.val_kwargs."):
        from megarl.config.schema import ValKwargs

        name = short.removeprefix("rollout.val_kwargs.")
        return to("rollout.val_kwargs." + name) if name in ValKwargs.model_fields else None
    if rest == "use_torch_compile" or short == "actor.use_torch_compile":
        return no_effect("torch.compile of verl's own helpers: speed only")
    if short.startswith("actor.checkpoint.") or short.startswith("critic.checkpoint."):
        return no_effect("megarl checkpoints the model, optimizer and scheduler together")
    return None


def rule_for(key: str) -> Optional[Rule]:
    """The rule of a verl key: its own in RULES, else its family's (optimizers, Megatron layouts, FSDP settings,
    validation sampling); None when megarl has no equivalent."""
    rule = RULES.get(key)
    if rule is not None:
        return rule
    short = key.removeprefix(AR)
    role, _, rest = short.partition(".")
    if role in ("actor", "critic") and rest.startswith("optim."):
        rule = _optim_rule(role, rest.removeprefix("optim."))
    elif role in ("actor", "ref", "critic") and rest.startswith("megatron."):
        name = rest.removeprefix("megatron.")
        rule = _megatron_rule(role, name)
        if rule is None and name.startswith(_TRANSFORMER):
            return None  # a TransformerConfig field without a rule: refused, whatever else its name contains
    elif role in ("actor", "ref") and rest.startswith("router_replay."):  # newer verl: beside megatron, not in it
        rule = _megatron_rule(role, rest)
    return rule or _other_family_rule(key, short, rest)


def known_keys() -> list[str]:
    """Every verl key the table has a rule for: RULES' own keys and each family's, expanded over the names the family
    takes (optimizer, Megatron layout and offload, routing replay, validation sampling). The configuration reference
    lists, for each megarl key, the verl keys here whose rule declares it (`rule.targets`)."""
    from megarl.config.schema import ValKwargs

    keys = set(RULES)
    optim = (*_OPTIM, "lr_warmup_steps", "lr_warmup_steps_ratio", "total_training_steps", "lr_decay_style",
             "warmup_style", "lr_scheduler_type")
    for role, prefix in (("actor", AR + "actor."), ("critic", "critic."), ("ref", AR + "ref.")):
        if role != "ref":
            keys |= {f"{prefix}optim.{name}" for name in optim}
        keys |= {f"{prefix}megatron.{name}" for name in (*_PARALLEL, *_MEGATRON_OFFLOAD, *_MEGATRON_SWITCHES,
                                                           "router_replay.mode")}
        keys |= {f"{prefix}megatron.{_TRANSFORMER}{name}" for name in (
            *_FUSIONS, "recompute_granularity", "recompute_method", "recompute_num_layers", "recompute_modules",
            "moe_router_dtype")}
        if role != "critic":
            keys.add(f"{prefix}router_replay.mode")
    keys |= {f"{AR}rollout.val_kwargs.{name}" for name in ValKwargs.model_fields}
    return sorted(k for k in keys if rule_for(k) is not None)
