"""Side by side: what verl would train for three of its own launch scripts (its flattened Megatron trainer config,
tests/fixtures/verl/upstream/_generated_ppo_megatron_trainer.yaml, with the script's config file and overrides applied
and its `${...}` interpolations resolved here, independently of the converter), against the megarl recipe
`convert-verl` writes: identical wherever megarl has the setting and the converter did not refuse the key."""
import copy
import re
from pathlib import Path

import pytest
import yaml

from megarl.config import load_unchecked
from megarl.convert_verl import convert, gather
from megarl.convert_verl.interpreter import read_script

UP = Path(__file__).resolve().parents[1] / "fixtures" / "verl" / "upstream"
ENV = {"HOME": "/home/u", "PATH": "/usr/bin", "aime24_test_path": "/d/aime.parquet"}
AR = "actor_rollout_ref."


def _value(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _merge(base: dict, top: dict) -> None:
    for k, v in top.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            _merge(base[k], v)
        else:
            base[k] = v


class VerlConfig:
    """verl's resolved config: defaults, then a config file, then key=value overrides; `${oc.select:a.b,d}` and
    `${a.b}` resolved on reading."""

    def __init__(self, config_file=None, overrides=()):
        self.tree = yaml.safe_load((UP / "_generated_ppo_megatron_trainer.yaml").read_text())
        if config_file:
            data = yaml.safe_load(Path(config_file).read_text())
            data.pop("hydra", None), data.pop("defaults", None)
            _merge(self.tree, data)
        for item in overrides:
            key, _, text = item.partition("=")
            node, *path = self.tree, *key.lstrip("+").split(".")
            for part in path[:-1]:
                node = node.setdefault(part, {})
            node[path[-1]] = _value(text)

    def get(self, key: str, default="<absent>"):
        node = self.tree
        for part in key.split("."):
            if not isinstance(node, dict) or part not in node:
                return default
            node = node[part]
        if isinstance(node, str):
            m = re.fullmatch(r"\$\{oc\.select:([^,}]+),\s*([^}]*)\}", node)
            if m:
                got = self.get(m.group(1))
                return _value(m.group(2)) if got == "<absent>" else got
            m = re.fullmatch(r"\$\{([\w.]+)\}", node)
            if m:
                return self.get(m.group(1))
        return node


# verl key -> megarl's resolved value (cfg -> value)
PAIRS = {
    "algorithm.adv_estimator": lambda c: c.algorithm.adv_estimator,
    "algorithm.use_kl_in_reward": lambda c: c.algorithm.use_kl_in_reward,
    "algorithm.kl_ctrl.kl_coef": lambda c: c.algorithm.kl_ctrl.kl_coef,
    "algorithm.gamma": lambda c: c.algorithm.gamma, "algorithm.lam": lambda c: c.algorithm.lam,
    "data.train_batch_size": lambda c: c.data.train_batch_size,
    "data.max_prompt_length": lambda c: c.rollout.prompt_length,
    "data.max_response_length": lambda c: c.rollout.response_length,
    AR + "actor.ppo_mini_batch_size": lambda c: c.actor.ppo_mini_batch_size,
    AR + "actor.ppo_micro_batch_size_per_gpu": lambda c: c.actor.ppo_micro_batch_size_per_gpu,
    AR + "actor.use_dynamic_bsz": lambda c: c.actor.use_dynamic_bsz,
    AR + "actor.ppo_max_token_len_per_gpu": lambda c: c.actor.ppo_max_token_len_per_gpu,
    AR + "actor.ppo_epochs": lambda c: c.actor.ppo_epochs,
    AR + "actor.clip_ratio_low": lambda c: c.actor.clip_low, AR + "actor.clip_ratio_high": lambda c: c.actor.clip_high,
    AR + "actor.clip_ratio_c": lambda c: c.actor.clip_ratio_c,
    AR + "actor.loss_agg_mode": lambda c: c.actor.loss_agg_mode,
    AR + "actor.policy_loss.loss_mode": lambda c: c.actor.policy_loss,
    AR + "actor.entropy_coeff": lambda c: c.actor.entropy_coeff,
    AR + "actor.use_kl_loss": lambda c: c.actor.use_kl_loss, AR + "actor.kl_loss_coef": lambda c: c.actor.kl_loss_coef,
    AR + "actor.kl_loss_type": lambda c: c.actor.kl_loss_type,
    AR + "actor.optim.lr": lambda c: c.actor.optim.lr, AR + "actor.optim.weight_decay": lambda c: c.actor.optim.weight_decay,
    AR + "actor.optim.clip_grad": lambda c: c.actor.optim.clip_grad,
    AR + "actor.megatron.tensor_model_parallel_size": lambda c: c.parallelism.tensor_model_parallel_size,
    AR + "actor.megatron.pipeline_model_parallel_size": lambda c: c.parallelism.pipeline_model_parallel_size,
    AR + "actor.megatron.virtual_pipeline_model_parallel_size": lambda c: c.parallelism.virtual_pipeline_model_parallel_size,
    AR + "actor.megatron.context_parallel_size": lambda c: c.parallelism.context_parallel_size,
    AR + "actor.megatron.expert_model_parallel_size": lambda c: c.parallelism.expert_model_parallel_size,
    AR + "actor.megatron.use_distributed_optimizer": lambda c: c.parallelism.use_distributed_optimizer,
    AR + "rollout.n": lambda c: c.rollout.n,
    AR + "rollout.temperature": lambda c: c.rollout.temperature, AR + "rollout.top_p": lambda c: c.rollout.top_p,
    AR + "rollout.top_k": lambda c: c.rollout.top_k,
    AR + "rollout.tensor_model_parallel_size": lambda c: c.rollout.tensor_model_parallel_size,
    AR + "rollout.log_prob_micro_batch_size_per_gpu": lambda c: c.rollout.log_prob_micro_batch_size_per_gpu,
    AR + "rollout.log_prob_use_dynamic_bsz": lambda c: c.rollout.log_prob_use_dynamic_bsz,
    AR + "rollout.log_prob_max_token_len_per_gpu": lambda c: c.rollout.log_prob_max_token_len_per_gpu,
    AR + "ref.log_prob_micro_batch_size_per_gpu": lambda c: c.ref.log_prob_micro_batch_size_per_gpu,
    AR + "rollout.multi_turn.enable": lambda c: c.rollout.multi_turn.enable,
    AR + "rollout.multi_turn.max_assistant_turns": lambda c: c.rollout.multi_turn.max_assistant_turns,
    "reward_model.reward_kwargs.overlong_buffer_cfg.enable": lambda c: c.reward.overlong_buffer.enable,
    "reward_model.reward_kwargs.overlong_buffer_cfg.len": lambda c: c.reward.overlong_buffer.len,
    "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor": lambda c: c.reward.overlong_buffer.penalty_factor,
    "trainer.total_epochs": lambda c: c.trainer.total_epochs,
    "trainer.nnodes": lambda c: c.trainer.nnodes, "trainer.n_gpus_per_node": lambda c: c.trainer.n_gpus_per_node,
    "trainer.test_freq": lambda c: c.trainer.test_freq,
}


def _side_by_side(script: Path, config_file=None):
    read = read_script(script, dict(ENV))
    verl = VerlConfig(config_file, read.overrides)
    inputs = gather([str(script)], dict(ENV))
    c = convert(inputs.settings, unresolved=inputs.unresolved, trainer=inputs.trainer, from_files=inputs.file_keys)
    cfg = load_unchecked(data=c.recipe)
    refused = {line.split(" = ")[0].removeprefix("(verl default) ") for line in c.refused}
    rows, compared = [], 0
    for key, megarl in PAIRS.items():
        want = verl.get(key)
        if want in ("<absent>", None) or key in refused or key.replace(".actor.", ".ref.") in refused:
            continue
        if key.endswith("test_freq") and want == -1:
            want = 0  # verl's -1 (never) is megarl's 0
        rows.append((key, want, megarl(cfg)))
        compared += 1
    # sequence parallelism: verl's config says true, its engine turns it off at TP 1
    tp = verl.get(AR + "actor.megatron.tensor_model_parallel_size")
    rows.append(("actor.megatron.sequence_parallel (effective)",
                 bool(verl.get(AR + "actor.megatron.sequence_parallel")) and tp > 1, cfg.parallelism.sequence_parallel))
    return rows, compared, refused, cfg


@pytest.mark.parametrize("script, config_file, at_least", [
    ("run_qwen2-7b_math_megatron.sh", None, 35),                    # dense GRPO
    ("run_qwen3moe-30b_megatron_96gb.sh", None, 38),               # MoE, DAPO-style (clip-higher, overlong buffer)
    ("run_qwen2.5-3b_megatron_gsm8k_multiturn.sh", "config/gsm8k_multiturn_megatron_grpo.yaml", 30),  # multi-turn
])
def test_converted_recipe_trains_what_verl_would(script, config_file, at_least):
    rows, compared, refused, cfg = _side_by_side(UP / script, UP / config_file if config_file else None)
    assert compared >= at_least
    assert [r for r in rows if r[1] != r[2]] == []
    if config_file:  # the file's settings arrived: multi-turn, five assistant turns
        assert cfg.rollout.multi_turn.enable and cfg.rollout.multi_turn.max_assistant_turns == 5
    if "moe" in script:  # DAPO's overlong shaping and verl's epochs
        assert (cfg.reward.overlong_buffer.len, cfg.trainer.total_epochs) == (4096, 10)
