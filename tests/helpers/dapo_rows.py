"""DAPO-Math-17k rows written by hand in the official layout (BytedTsinghua-SIA/DAPO-Math-17k), and
tools/data/dapo_math.py loaded as a module (tools/ is not a package)."""
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "data" / "dapo_math.py"

# the official file's instruction around each problem, word for word from the dataset's rows
HEAD = ("Solve the following math problem step by step. The last line of your response should be of the form "
        "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n")
FOOT = '\n\nRemember to put your answer on its own line after "Answer:".'


def official_row(problem: str, answer: str, uuid: str) -> dict:
    return {"data_source": "math_dapo",
            "prompt": [{"content": HEAD + problem + FOOT, "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": uuid}}


def load_script():
    name = "_megarl_tools_data_dapo_math"  # a private name keeps it off any other `import dapo_math`
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
