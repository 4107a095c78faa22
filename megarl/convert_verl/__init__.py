"""`megarl convert-verl`: a verl config, command line or launch script -> a megarl recipe (see convert.py)."""
from megarl.convert_verl.convert import (DESCRIPTION, HUGE_STEPS, RULES, VERL_FIXED_AGGREGATION, add_arguments,
                                         convert, gather, read_inputs, run, script_overrides)
from megarl.convert_verl.interpreter import ShellParseError, read_script

__all__ = ["DESCRIPTION", "HUGE_STEPS", "RULES", "VERL_FIXED_AGGREGATION", "ShellParseError", "add_arguments",
           "convert", "gather", "read_inputs", "read_script", "run", "script_overrides"]
