"""Recipe configuration: a typed tree loaded from YAML with `a.b=c` overrides and held against its schema, every problem
in one report. The rules across fields live beside each feature and megarl.validate.load_config applies them too.

    cfg, issues = parse_config("recipes/grpo_tiny_cpu.yaml", ["rollout.temperature=0.7", "trainer.total_steps=10"])

A recipe may extend another with `base: other.yaml` (relative to the recipe). Field names follow verl's conventions.
"""
from megarl.config.issues import ConfigError, Issue
from megarl.config.loader import config_or_error, load_unchecked, parse_config, read_recipe
from megarl.config.resolve import derived, resolved_dict, to_yaml, write_resolved
from megarl.config.schema import *  # noqa: F401,F403  (the section classes)
from megarl.config.schema import MegarlConfig

__all__ = ["ConfigError", "Issue", "MegarlConfig", "config_or_error", "derived", "load_unchecked", "parse_config",
           "read_recipe", "resolved_dict", "to_yaml", "write_resolved"]
