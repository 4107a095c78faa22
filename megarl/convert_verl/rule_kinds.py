"""The kinds of rule a verl key can have, and the rules that read a value before mapping it.

A rule is `rule(c, verl_key, value)`: it writes what became of the key into the Conversion `c` (mapped to a megarl key,
dropped because megarl does that anyway, or refused with what to do). The builders here (`to`, `no_effect`,
`accept`, `off_only`, ...) make the rules of megarl.convert_verl.rules' table; the functions named after a verl key
(`logger`, `truncation`, ...) are the rules of keys whose value needs its own reading.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

from megarl.convert_verl.record import Conversion, get_key

Rule = Callable[[Conversion, str, Any], None]


def sets(*keys: str):
    """Declare the megarl keys a rule can write (`rule.targets`; none for a rule that only drops or refuses): the
    configuration reference lists each rule's verl key beside them, and a test applies every rule to probe values and
    fails on a key it writes without declaring it."""
    def mark(rule):
        rule.targets = tuple(keys)
        return rule
    return mark


def _optional(key: str) -> bool:
    """Whether megarl's field `key` accepts None (null)."""
    from megarl.config.loader import _model_fields
    from megarl.config.schema import MegarlConfig

    cls, parts = MegarlConfig, key.split(".")
    for part in parts[:-1]:
        cls = _model_fields(cls).get(part)
        if cls is None:
            return False
    info = cls.model_fields.get(parts[-1])
    return info is not None and not info.is_required() and (info.default is None or type(None) in
                                                            getattr(info.annotation, "__args__", ()))


def to(key: str, fn: Optional[Callable[[Any], Any]] = None):
    """A rule mapping the verl value to `key` (through fn); null maps to null where megarl's key takes it, and
    otherwise leaves megarl's default (verl's null means 'unset')."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value is None and not _optional(key):
            c.drop(verl_key, value, f"null (unset): megarl keeps its default for {key}")
            return
        c.set(verl_key, value, key, fn(value) if fn and value is not None else None)
    return sets(key)(rule)


def files(value: Any) -> list:
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError("expected a file path or a list of them")


def _is(value: Any, choices: tuple) -> bool:
    """`value in choices` without Python's True == 1 (an offload=True must not pass for a size of 1)."""
    return any(value is c or (type(value) is type(c) and value == c) for c in choices)


def no_effect(why: str):
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        c.drop(verl_key, value, why)
    return sets()(rule)


def accept(allowed: tuple, why: str, refused: str):
    """Keys whose allowed values ask for what megarl does anyway (dropped, with why); anything else is refused."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if _is(value, allowed):
            c.drop(verl_key, value, why)
        else:
            c.refuse(verl_key, value, refused)
    return sets()(rule)


def off_only(why_off: str, why_refused: str, off: tuple = (None, False, 0, "", [])):
    """Keys whose off value is what megarl does anyway."""
    return accept(off, why_off, why_refused)


def freq(key: str):
    """verl's -1 (never) is megarl's 0."""
    return to(key, lambda v: 0 if int(v) < 0 else int(v))


@sets("model.recompute")
def recompute(c: Conversion, verl_key: str, value: Any) -> None:
    if c.trainer == "ppo_megatron_trainer" and verl_key.endswith("enable_gradient_checkpointing"):
        # verl's Megatron workers recompute per override_transformer_config.recompute_*; this FSDP switch is unread
        c.drop(verl_key, value, "read by verl's FSDP workers only; its Megatron trainer recomputes per "
                                "override_transformer_config.recompute_granularity")
        return
    c.set(verl_key, value, "model.recompute", "full" if value else "none")


@sets("model.recompute")
def recompute_granularity(c: Conversion, verl_key: str, value: Any) -> None:
    if value in (None, "full", "selective"):
        c.set(verl_key, value, "model.recompute", value or "none")
    else:
        c.refuse(verl_key, value, "megarl recomputes 'full' layers or 'selective' (the attention core), or nothing")


def recompute_detail(allowed: tuple, what: str):
    return accept(allowed, f"megarl's {what}", "megarl's full recomputation is uniform over 1-layer chunks and its "
                  "selective one recomputes the attention core; drop it")


def steps_or_unset(key: str, why_unset: str):
    """verl's -1 / null mean 'derive it' (warm-up from a ratio, steps from epochs)."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value is None or (isinstance(value, int) and not isinstance(value, bool) and value < 0):
            c.drop(verl_key, value, why_unset)
        else:
            c.set(verl_key, value, key)
    return sets(key)(rule)


def refuse(why: str):
    """Keys megarl reads elsewhere or not at all, whatever their value."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        c.refuse(verl_key, value, why)
    return sets()(rule)


def decided_later(*targets: str):
    """Keys decided once every other key is known (megarl.convert_verl.verl_behaviour.derive), which writes
    `targets`."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        c.later[verl_key] = value
    return sets(*targets)(rule)


@sets("parallelism.context_parallel_size")
def context_parallel(c: Conversion, verl_key: str, value: Any) -> None:
    """actor/ref/critic.megatron.context_parallel_size -> parallelism.context_parallel_size (one for all three); above 1
    the first mapped line says how megarl cuts the sequences (megatron's load-balanced chunks, as verl's Megatron
    workers cut them)."""
    key = "parallelism.context_parallel_size"
    if value is None:
        c.drop(verl_key, value, f"null (unset): megarl keeps its default for {key}")
        return
    why = ""
    first = key not in c.sources or c.layers.get(key, 0) < c.layer  # a later layer's line replaces the earlier's
    if isinstance(value, int) and not isinstance(value, bool) and value > 1 and first:
        why = (f"megarl splits each sequence into 2*CP = {2 * value} load-balanced chunks, CP rank r holding chunks r "
               f"and {2 * value - 1}-r (megatron's order), each packed row padded to a multiple of {2 * value} "
               "tokens; token budgets stay per GPU (a micro-batch holds CP times one), as in verl")
    c.set(verl_key, value, key, why=why)


@sets("model.moe_router_dtype")
def router_dtype(c: Conversion, verl_key: str, value: Any) -> None:
    if value in (None, "fp32", "fp64"):
        c.set(verl_key, value, "model.moe_router_dtype")
    else:
        c.refuse(verl_key, value, "megatron computes the router in fp32 or fp64 (or the model dtype: null)")


@sets("model.dtype")
def megatron_dtype(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("bfloat16", "float16", "float32"):
        c.set(verl_key, value, "model.dtype")
    else:
        c.refuse(verl_key, value, "megarl trains in float32, bfloat16 or float16 (model.dtype)")


@sets("data.truncation")
def truncation(c: Conversion, verl_key: str, value: Any) -> None:
    if value == "middle":
        c.refuse(verl_key, value, "megarl truncates prompts from the left or right only; use 'left' or 'right'")
    elif get_key(c.recipe, "data.truncation") == "filter":  # filter_overlong_prompts came first and decides
        c.drop(verl_key, value, "data.filter_overlong_prompts=True already drops long prompts (data.truncation=filter)")
    else:
        c.set(verl_key, value, "data.truncation")


@sets("data.truncation")
def filter_overlong(c: Conversion, verl_key: str, value: Any) -> None:
    if value:
        c.set(verl_key, value, "data.truncation", "filter")
    else:
        c.drop(verl_key, value, "off: prompts over data.max_prompt_length follow data.truncation")


@sets("logging.wandb.enable", "logging.tensorboard")
def logger(c: Conversion, verl_key: str, value: Any) -> None:
    names = [value] if isinstance(value, str) else list(value or [])
    if not names:
        c.drop(verl_key, value, "no logger: megarl still prints a line per reported step")
    for name in names:
        if name == "wandb":
            c.set(verl_key, value, "logging.wandb.enable", True)
        elif name == "tensorboard":
            c.set(verl_key, value, "logging.tensorboard", True)
        elif name != "console":
            c.refuse(verl_key, name, "megarl logs to the console, metrics.jsonl, tensorboard and wandb only")
    if names == ["console"]:
        c.drop(verl_key, value, "megarl always prints a line per reported step")


@sets()
def rollout_name(c: Conversion, verl_key: str, value: Any) -> None:
    if value == "vllm":
        c.drop(verl_key, value, "vLLM is megarl's engine")
    else:
        c.refuse(verl_key, value, "megarl's rollout engine is vLLM; drop this key")


@sets("rollout.load_format")
def load_format(c: Conversion, verl_key: str, value: Any) -> None:
    fmt = "dummy" if str(value).startswith("dummy") else value
    if fmt in ("dummy", "auto", "safetensors"):
        c.set(verl_key, value, "rollout.load_format", fmt)
    else:
        c.refuse(verl_key, value, "megarl's engine loads 'dummy', 'auto' or 'safetensors' weights")


@sets("actor.lora.sync")
def lora_merge(c: Conversion, verl_key: str, value: Any) -> None:
    if value in (True, False, None):
        c.set(verl_key, value, "actor.lora.sync", "merged" if value else "adapter")
    else:
        c.refuse(verl_key, value, "true (merged weights into the engine) or false (adapters into vLLM's LoRA support)")


@sets("checkpoint.resume")
def resume_mode(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("auto", "disable"):
        c.set(verl_key, value, "checkpoint.resume")
    else:  # resume_path: the path comes with trainer.resume_from_path
        c.drop(verl_key, value, "the checkpoint path comes from trainer.resume_from_path")


@sets()
def reward_manager(c: Conversion, verl_key: str, value: Any) -> None:
    if value in ("naive", "dapo", None):
        c.drop(verl_key, value, "megarl scores each sample with the reward function; overlong shaping is "
                                "reward.overlong_buffer")
    else:
        c.refuse(verl_key, value, "megarl has one reward manager (per-sample functions)")


@sets("algorithm.rollout_correction.rejection_threshold")
def rs_threshold(c: Conversion, verl_key: str, value: Any) -> None:
    if value is None:
        c.drop(verl_key, value, "unset")
    elif isinstance(value, (int, float)) and value > 1:
        c.set(verl_key, value, "algorithm.rollout_correction.rejection_threshold", float(value))
    else:
        c.refuse(verl_key, value, "megarl rejects ratios outside [1/threshold, threshold] for one threshold > 1")


def level(key: str, levels: tuple[str, ...]):
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value is None:
            c.drop(verl_key, value, "off (megarl's default)")
        elif value in levels:
            c.set(verl_key, value, key)
        else:
            c.refuse(verl_key, value, f"megarl supports {', '.join(levels)} here")
    return sets(key)(rule)


@sets("actor.policy_loss")
def policy_loss(c: Conversion, verl_key: str, value: Any) -> None:
    from megarl.algo import POLICY_LOSSES

    if value in POLICY_LOSSES:
        c.set(verl_key, value, "actor.policy_loss")
    else:
        c.refuse(verl_key, value, f"megarl's policy losses are {sorted(POLICY_LOSSES)}")


# verl 0.9.1's policy losses whose policy term does not follow actor.loss_agg_mode (verl/trainer/ppo/core_algos.py;
# vanilla, gspo, cispo, gpg, clip_cov, kl_cov, dro, dppo_tv, dppo_kl and bypass_mode's losses pass the mode on to
# agg_loss): the megarl mode that computes what verl computes, and what verl does. megarl's losses all follow the mode,
# so the recipe names verl's aggregation. verl's entropy bonus and KL loss still follow loss_agg_mode.


def lr_schedule(key: str):
    """verl's warmup_style / lr_scheduler_type / lr_decay_style -> megarl's `key` (ROLE.optim.lr_decay_style)."""
    def rule(c: Conversion, verl_key: str, value: Any) -> None:
        if value in ("constant", "cosine", "linear"):
            c.set(verl_key, value, key)
        else:
            c.refuse(verl_key, value, "megarl schedules: constant, linear, cosine")
    return sets(key)(rule)

