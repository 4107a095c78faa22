"""Finding reward functions: the registry of named rules, custom 'file.py:function' specs, per-row routing."""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable, Iterable, Optional

import megarl.reward.rules as rules

RewardFn = Callable[..., Any]


class RewardError(RuntimeError):
    """A reward function could not be found, loaded or run; the message names the file, function or sample."""


REGISTRY: dict[str, RewardFn] = {}
# data_source value -> registered name (verl dataset names users already have map to our rules)
ALIASES: dict[str, str] = {}


def register_reward(name: str, fn: RewardFn, aliases: Iterable[str] = ()) -> RewardFn:
    """Add fn under `name`; rows whose data_source is name or one of aliases are routed to it."""
    if not callable(fn):
        raise TypeError(f"reward {name!r}: {fn!r} is not callable")
    REGISTRY[name] = fn
    ALIASES[name] = name
    for alias in aliases:
        ALIASES[alias] = name
    return fn


register_reward("gsm8k", rules.gsm8k, aliases=["openai/gsm8k"])
register_reward("math", rules.math, aliases=["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                                             "HuggingFaceH4/MATH-500", "hendrycks_math"])
register_reward("geo3k", rules.geo3k, aliases=["hiyouga/geometry3k"])  # verl's geo3k.py data_source
register_reward("math_dapo", rules.math_dapo)  # DAPO-Math-17k and its AIME-2024 set use this data_source
register_reward("exact_match", rules.exact_match)
register_reward("format_regex", rules.format_regex)
register_reward("format_think_answer", rules.format_think_answer)
register_reward("arithmetic", rules.arithmetic, aliases=["megarl/arithmetic"])
# the synthetic image task (megarl.data.synthetic_shapes): its answers are "#### N" counts
register_reward("shapes", rules.arithmetic)
register_reward("multiply_tool", rules.multiply_tool)
register_reward("walk", rules.walk)


def _known() -> str:
    aliases = sorted(a for a, n in ALIASES.items() if a != n)
    return f"registered rewards: {sorted(REGISTRY)}; data_source aliases: {aliases}"


# ----------------------------------------------------------------------------------------------------------------------
# Custom functions from files


def load_reward_fn(spec: str) -> RewardFn:
    """Import a function from 'path/to/file.py:function' ('path/to/file.py' alone means function compute_score,
    verl's convention). Relative paths are relative to the working directory."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):  # no ':' (or a Windows-style drive colon only): the whole spec is the file
        path, name = spec, "compute_score"
    if not path.endswith(".py"):
        raise RewardError(f"reward.reward_fn={spec!r} is not a registered name nor 'path/to/file.py:function'; "
                          f"{_known()}")
    if not os.path.isfile(path):
        raise RewardError(f"reward function file not found: {path!r} (absolute: {os.path.abspath(path)!r}, from "
                          f"reward.reward_fn={spec!r}); fix the path (relative paths start at {os.getcwd()!r})")
    # A unique module name per file: two reward files both called reward.py must not overwrite each other.
    digest = hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:10]
    module_name = f"megarl_user_reward_{os.path.splitext(os.path.basename(path))[0]}_{digest}"
    module = sys.modules.get(module_name)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module  # pickling and dataclasses look the module up by name
        try:
            module_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[module_name]
            raise RewardError(f"importing reward file {path!r} failed: {type(e).__name__}: {e}") from e
    if not hasattr(module, name):
        functions = sorted(k for k, v in vars(module).items()
                           if inspect.isfunction(v) and v.__module__ == module_name and not k.startswith("_"))
        raise RewardError(f"function {name!r} not found in reward file {path!r}; functions defined there: {functions}; "
                          f"set reward.reward_fn='{path}:<one of them>'")
    fn = getattr(module, name)
    if not callable(fn):
        raise RewardError(f"{name!r} in reward file {path!r} is a {type(fn).__name__}, not a function; "
                          f"reward.reward_fn must name a callable")
    return fn


def get_reward_fn(spec: str) -> RewardFn:
    """A registered name (or data_source alias) -> its function; anything with '.py' -> load_reward_fn."""
    if spec in ALIASES:
        return REGISTRY[ALIASES[spec]]
    if ".py" in spec:
        return load_reward_fn(spec)
    raise RewardError(f"unknown reward.reward_fn={spec!r}; {_known()}; or give 'path/to/file.py:function'")


# ----------------------------------------------------------------------------------------------------------------------
# Routing by data_source


class RewardRouter:
    """Picks each row's function from its data_source (used when reward.reward_fn is None).

    Callable with the uniform signature, so compute_rewards treats it like any reward function; `resolve` lets
    callers check all data_sources once, before any rollout is spent.
    """

    def __init__(self, overrides: Optional[dict[str, RewardFn]] = None):
        self.overrides = dict(overrides or {})

    def resolve(self, data_source: str) -> RewardFn:
        if data_source in self.overrides:
            return self.overrides[data_source]
        name = ALIASES.get(data_source) or ALIASES.get(str(data_source).lower())
        if name is None:
            raise RewardError(f"no reward function for data_source={data_source!r}; {_known()}; set reward.reward_fn "
                              f"to a registered name or 'path/to/file.py:function', or fix the data_source column")
        return REGISTRY[name]

    def check(self, data_sources: Iterable[str]) -> None:
        for ds in sorted(set(data_sources)):
            self.resolve(ds)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Optional[dict] = None,
                 **reward_kwargs: Any) -> Any:
        return self.resolve(data_source)(data_source, solution_str, ground_truth, extra_info, **reward_kwargs)


def reward_fn_from_config(reward_cfg: Any) -> RewardFn:
    """reward.reward_fn -> a function, or a RewardRouter when it is None."""
    return RewardRouter() if reward_cfg.reward_fn is None else get_reward_fn(reward_cfg.reward_fn)
