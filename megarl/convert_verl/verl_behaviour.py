"""What verl does that its keys do not say: the defaults of its base trainers that differ from megarl's (applied under
the user's settings), the settings it derives from others, and the policy losses that fix their own aggregation.

Each is written into the recipe as what verl would have trained, labelled `(verl default)` where no key of the user's
set it; what megarl would still train differently is listed as DIFFERS.
"""
from __future__ import annotations

from typing import Any

from megarl.convert_verl.record import Conversion, get_key

AR = "actor_rollout_ref."
# verl's defaults (verl/trainer/config/_generated_ppo_trainer.yaml and _generated_ppo_megatron_trainer.yaml) that
# differ from megarl's and change what is trained or where; applied under the user's settings, through the same rules.
_VERL_COMMON_DEFAULTS = {
    "algorithm.adv_estimator": "gae",
    "data.train_batch_size": 1024,
    AR + "actor.ppo_mini_batch_size": 256,
    AR + "rollout.tensor_model_parallel_size": 2,
    "trainer.n_gpus_per_node": 8,
    "trainer.total_epochs": 30,
    "trainer.device": "cuda",
}
TRAINER_DEFAULTS = {
    "ppo_trainer": dict(_VERL_COMMON_DEFAULTS),
    "ppo_megatron_trainer": {**_VERL_COMMON_DEFAULTS,
                             AR + "actor.megatron.sequence_parallel": True,  # verl turns it off at TP 1 (kept so here)
                             AR + "actor.megatron.use_distributed_optimizer": True},
}
BASE_TRAINERS = tuple(TRAINER_DEFAULTS)


def base_trainer(name: str) -> str:
    """verl's base trainer a config name stands for: the Megatron one for any '*megatron*' name."""
    return "ppo_megatron_trainer" if "megatron" in name else "ppo_trainer"


def derive(c: Conversion) -> None:
    """Settings verl derives from others: sequence parallelism off at TP 1, the log-prob token budgets following the
    actor's, LoRA adapters into the engine, DAPO's reward length and generation batch."""
    _sequence_parallel_at_tp1(c)
    _log_prob_budgets(c)
    _lora_rollout(c)
    for key, value in c.later.items():
        if key.endswith("max_resp_len"):
            _overlong_length(c, key, value)
        elif key == "data.gen_batch_size":
            _generation_batch(c, key, value)


def _sequence_parallel_at_tp1(c: Conversion) -> None:
    tp = get_key(c.recipe, "parallelism.tensor_model_parallel_size", 1)
    if get_key(c.recipe, "parallelism.sequence_parallel") and tp == 1:
        verl_key = c.unset("parallelism.sequence_parallel")
        c.drop(verl_key, True, "verl turns sequence parallelism off at tensor_model_parallel_size 1 (so does megarl)")


def _log_prob_budgets(c: Conversion) -> None:
    for actor_key, megarl_key in (("actor.use_dynamic_bsz", "rollout.log_prob_use_dynamic_bsz"),
                                  ("actor.ppo_max_token_len_per_gpu", "rollout.log_prob_max_token_len_per_gpu")):
        value = get_key(c.recipe, actor_key)
        if value is not None and get_key(c.recipe, megarl_key) is None:  # verl: ${oc.select:actor_rollout_ref.actor...}
            with c.verl_default():
                c.set(f"{AR}rollout.{megarl_key.rsplit('.', 1)[1]}", f"as {AR}{actor_key}", megarl_key, value)


def _lora_rollout(c: Conversion) -> None:
    rank = get_key(c.recipe, "actor.lora.rank")
    if isinstance(rank, int) and rank > 0 and get_key(c.recipe, "actor.lora.sync") is None:
        # verl's LoRA rollout loads the adapters into vLLM (model.lora.merge: false) unless told to merge
        with c.verl_default():
            c.set(f"{AR}model.lora.merge", False, "actor.lora.sync", "adapter")


def _overlong_length(c: Conversion, key: str, value: Any) -> None:
    length = get_key(c.recipe, "rollout.response_length", 512)
    if value is None or value == length:
        c.drop(key, value, "megarl's overlong buffer ends at rollout.response_length (the same length)")
    else:
        c.refuse(key, value, f"megarl's overlong penalty counts up to rollout.response_length = {length}; set "
                             "max_resp_len to data.max_response_length")


def _generation_batch(c: Conversion, key: str, value: Any) -> None:
    train = get_key(c.recipe, "data.train_batch_size", 8)
    if value is None or value == train:
        c.drop(key, value, "generation rounds of data.train_batch_size prompts (megarl's default)")
    elif isinstance(value, int) and value > train:
        c.set(key, value, "rollout.over_sample_rate", (value - train) / train)
    else:
        c.refuse(key, value, "megarl generates at least data.train_batch_size prompts per round; drop it")


# verl 0.9.1's policy losses whose policy term does not follow actor.loss_agg_mode (verl/trainer/ppo/core_algos.py;
# vanilla, gspo, cispo, gpg, clip_cov, kl_cov, dro, dppo_tv, dppo_kl and bypass_mode's losses pass the mode on to
# agg_loss): the megarl mode that computes what verl computes, and what verl does. megarl's losses all follow the mode,
# so the recipe names verl's aggregation. verl's entropy bonus and KL loss still follow loss_agg_mode.
VERL_FIXED_AGGREGATION = {
    "sapo": ("seq-mean-token-mean", "verl 0.9.1's sapo aggregates its policy loss seq-mean-token-mean whatever "
                                    "loss_agg_mode says"),
    "geo_mean": ("seq-mean-token-mean", "verl 0.9.1's geo_mean takes the mean over sequences of each sequence's "
                                        "loss, loss_agg_mode 'not used'"),
}
_GEO_MEAN_MICRO_BATCHES = (
    "verl 0.9.1 takes geo_mean's mean over each micro-batch's sequences and adds the micro-batches (unlike its other "
    "losses it ignores the mini-batch's size), so its gradient is about (micro-batches per mini-batch and rank) times "
    "the mean over the mini-batch's sequences, and with use_dynamic_bsz a sequence in a smaller micro-batch weighs "
    "more; megarl divides by the mini-batch's sequence count (the paper's mean; verl's too with one micro-batch per "
    "mini-batch and rank)")


def _active(value: Any, default: Any) -> bool:
    """A loss term's switch or coefficient that is on (a value validate will refuse counts as off here)."""
    value = default if value is None else value
    return value is not False and isinstance(value, (bool, int, float)) and value != 0


def fixed_aggregation(c: Conversion) -> None:
    """Where verl's policy loss fixes its own aggregation, the recipe's loss_agg_mode says it (megarl's losses follow
    the mode); what megarl then aggregates differently from verl is listed in c.differs."""
    loss = get_key(c.recipe, "actor.policy_loss")
    if loss not in VERL_FIXED_AGGREGATION:
        return
    mode, what = VERL_FIXED_AGGREGATION[loss]
    if loss == "geo_mean":
        c.differs.append(f"{AR}actor.policy_loss.loss_mode = 'geo_mean': {_GEO_MEAN_MICRO_BATCHES}")
    verl_mode = get_key(c.recipe, "actor.loss_agg_mode", "token-mean")  # verl's default is megarl's
    if verl_mode == mode:
        return
    verl_key = c.unset("actor.loss_agg_mode")
    with c.verl_default(not verl_key):
        c.set(verl_key or AR + "actor.loss_agg_mode", verl_mode, "actor.loss_agg_mode", mode,
              why=f"{what}; megarl's {loss} follows the mode, so the recipe names verl's")
    terms = [name for name, on in (
        ("KL loss", _active(get_key(c.recipe, "actor.use_kl_loss"), False)
         and _active(get_key(c.recipe, "actor.kl_loss_coef"), 0.001)),
        ("entropy bonus", _active(get_key(c.recipe, "actor.entropy_coeff"), 0.0))) if on]
    if terms:
        both = " and ".join(terms)
        c.differs.append(f"{AR}actor.loss_agg_mode = {verl_mode!r}: verl aggregates the {both} with it and only "
                         f"{loss}'s policy term {mode}; megarl's one actor.loss_agg_mode serves all, so the {both} "
                         f"weigh each sequence equally here instead of as {verl_mode!r} does; for the same objective "
                         f"in both, set {AR}actor.loss_agg_mode={mode} in the verl run")
