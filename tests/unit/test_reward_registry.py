"""Finding reward functions: names, custom files, per-row routing."""
import pytest

from megarl.config.schema import RewardConfig
from megarl.reward import (RewardError, RewardRouter, get_reward_fn, load_reward_fn, reward_fn_from_config, rules)

CUSTOM = '''
import math

def my_reward(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    return float(solution_str == ground_truth) + bonus

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": 0.5, "length": len(solution_str)}

def _private():
    pass

NOT_A_FUNCTION = 3
'''


@pytest.fixture()
def reward_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(CUSTOM)
    return str(path)


def test_load_custom_function_from_file(reward_file):
    fn = load_reward_fn(f"{reward_file}:my_reward")
    assert fn("x", "a", "a") == 1.0 and fn("x", "a", "b", bonus=0.5) == 0.5
    assert load_reward_fn(reward_file)("x", "abc", "") == {"score": 0.5, "length": 3}  # verl's default name
    assert get_reward_fn(f"{reward_file}:my_reward") is fn  # imported once


def test_missing_file_names_the_path(tmp_path):
    missing = str(tmp_path / "nope.py")
    with pytest.raises(RewardError, match=r"reward function file not found: '.*nope\.py'"):
        load_reward_fn(f"{missing}:fn")


def test_missing_function_lists_what_exists(reward_file):
    with pytest.raises(RewardError) as e:
        load_reward_fn(f"{reward_file}:score_fn")
    msg = str(e.value)
    assert "function 'score_fn' not found in reward file" in msg and "my_rewards.py" in msg
    assert "['compute_score', 'my_reward']" in msg and "_private" not in msg


def test_not_callable_and_broken_file(reward_file, tmp_path):
    with pytest.raises(RewardError, match=r"'NOT_A_FUNCTION' in reward file .* is a int, not a function"):
        load_reward_fn(f"{reward_file}:NOT_A_FUNCTION")
    broken = tmp_path / "broken.py"
    broken.write_text("def f(:\n")
    with pytest.raises(RewardError, match=r"importing reward file .*broken\.py' failed: SyntaxError"):
        load_reward_fn(f"{broken}:f")


def test_registered_names_and_unknown_name():
    assert get_reward_fn("gsm8k") is rules.gsm8k and get_reward_fn("openai/gsm8k") is rules.gsm8k
    with pytest.raises(RewardError, match=r"unknown reward.reward_fn='gsm9k'.*'arithmetic'.*'gsm8k'"):
        get_reward_fn("gsm9k")


def test_router_by_data_source():
    router = RewardRouter()
    assert router.resolve("openai/gsm8k") is rules.gsm8k
    assert router.resolve("lighteval/MATH") is rules.math
    assert router.resolve("arithmetic") is rules.arithmetic
    assert router.resolve("GSM8K") is rules.gsm8k  # case-insensitive fallback
    assert router("openai/gsm8k", "#### 3", "3") == 1.0
    with pytest.raises(RewardError, match=r"no reward function for data_source='my/dataset'; registered rewards: "
                                          r"\[.*'exact_match'.*\].*set reward.reward_fn"):
        router.check(["arithmetic", "my/dataset"])


def test_from_config(reward_file):
    assert isinstance(reward_fn_from_config(RewardConfig()), RewardRouter)
    assert reward_fn_from_config(RewardConfig(reward_fn="math")) is rules.math
    assert reward_fn_from_config(RewardConfig(reward_fn=f"{reward_file}:my_reward"))("x", "a", "a") == 1.0
