"""`megarl convert-verl`: a verl Hydra config (YAML), verl command line or launch script -> a megarl recipe.

Every verl key is either mapped (printed as `verl key = value -> megarl key = value`), dropped because it asks for
nothing megarl would do differently (printed with the reason), or refused by name with what to do instead. Scripts are
read as bash would expand them, never run; an override naming a variable that cannot be resolved is refused by the
variable's name. `--config-path/--config-name` files (and their Hydra `defaults`) are read. The defaults of the verl
trainer the command names (ppo_trainer, or ppo_megatron_trainer with its sequence parallelism and distributed
optimizer) that differ from megarl's are applied first, so the recipe trains what the verl command would have. Where
verl's code computes something other than its keys say (sapo and geo_mean fix their own aggregation), the recipe names
what verl computes; what megarl would still train differently is listed as DIFFERS (and fails --strict). Finally the
recipe goes through `megarl validate`'s own checks.

The modules, each importing only those listed before it:
- reading a launch script: lexer (words and quoting) -> parser (commands and blocks) -> variables (known and unknown
  values) -> expansion (`${...}`, arithmetic, pure command substitutions) -> interpreter (the verl command's arguments)
- record (the recipe being built and the report), verl_behaviour (verl's trainer defaults, derived settings and fixed
  aggregation), inputs (configs, scripts and overrides gathered, with Hydra's defaults list as verl's configs use it)
- rule_kinds (the kinds of rule) -> rules (the verl key -> megarl key table) -> convert (the conversion) -> cli
"""
from megarl.convert_verl.convert import convert
from megarl.convert_verl.inputs import gather

__all__ = ["convert", "gather"]
