"""The chain task: questions of 2 to 16 distinct terms whose worked answers have a long tail of lengths, its tokenizer's exact
round trip, and the arithmetic reward on its answers."""
import statistics

import pytest

from megarl.config.schema import MegarlConfig
from megarl.data import arithmetic_tokenizer
from megarl.data.checks import check_synthetic
from megarl.data.synthetic import (CHAIN_MAX_TERMS, arithmetic_vocab, chain_term_weights, format_chain_question,
                                   format_chain_response, make_chain_dataset)
from megarl.reward import RewardInput, RewardRouter, compute_rewards


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("chain_tok")
    arithmetic_tokenizer(str(path), max_operand=20, task="chain")
    return AutoTokenizer.from_pretrained(str(path))


def test_a_hand_example_of_question_and_worked_answer():
    assert format_chain_question([3, 5, 2]) == "What is 3 + 5 + 2 ?"
    assert format_chain_response([3, 5, 2]) == "3 + 5 = 8 , 8 + 2 = 10 #### 10"
    assert format_chain_response([4, 0]) == "4 + 0 = 4 #### 4"
    assert format_chain_response([3, 5, 2], "gsm8k") == "#### 10"
    assert format_chain_response([3, 5, 2], "short") == "10"
    with pytest.raises(ValueError, match="at least 2 terms"):
        format_chain_response([7])


def test_a_slipping_demonstrator_goes_on_from_the_sum_it_wrote():
    assert format_chain_response([3, 5, 2], slips=[1, 0]) == "3 + 5 = 9 , 9 + 2 = 11 #### 11"
    assert format_chain_response([3, 5, 2], slips=[0, -2]) == "3 + 5 = 8 , 8 + 2 = 8 #### 8"
    with pytest.raises(ValueError, match="3 terms take 2 slips"):
        format_chain_response([3, 5, 2], slips=[1])
    exact, sloppy = make_chain_dataset(2000, seed=2), make_chain_dataset(2000, seed=2, slip_share=0.2)
    assert [r["prompt"] for r in exact] == [r["prompt"] for r in sloppy]  # the same questions whatever the share
    assert [r["ground_truth"] for r in exact] == [r["ground_truth"] for r in sloppy]  # the true sums
    steps = sum(len(r["extra_info"]["terms"]) - 1 for r in sloppy)
    slipped = sum(r["extra_info"]["slips"] for r in sloppy)
    assert abs(slipped / steps - 0.2) < 3 * (0.2 * 0.8 / steps) ** 0.5  # within 3 standard errors
    for r in sloppy:
        written = [int(step.split(" = ")[1]) for step in r["response"].split(" #### ")[0].split(" , ")]
        assert r["response"].endswith(f"#### {written[-1]}") and all(0 <= w <= 200 for w in written)
        assert (written[-1] == sum(r["extra_info"]["terms"])) or r["extra_info"]["slips"] > 0


def test_term_weights_are_a_truncated_zipf_law():
    weights = chain_term_weights(4, tail=1.0)  # 1/2 : 1/3 : 1/4 = 6 : 4 : 3
    assert weights == pytest.approx({2: 6 / 13, 3: 4 / 13, 4: 3 / 13})
    default = chain_term_weights()
    assert list(default) == list(range(2, CHAIN_MAX_TERMS + 1)) and sum(default.values()) == pytest.approx(1.0)
    assert 0.5 < default[2] < 0.55 and default[16] < 0.005


def test_rows_are_reproducible_and_their_worked_answers_add_up():
    rows = make_chain_dataset(200, seed=3)
    assert rows == make_chain_dataset(200, seed=3) and rows != make_chain_dataset(200, seed=4)
    for row in rows:
        terms = row["extra_info"]["terms"]
        assert 2 <= len(terms) <= 16 and all(0 <= t <= 20 for t in terms) and len(set(terms)) == len(terms)
        assert row["prompt"] == [{"role": "user", "content": format_chain_question(terms)}]
        assert row["ground_truth"] == str(sum(terms)) and row["data_source"] == "arithmetic"
        # read the partial sums back from the text: each step starts from the previous step's result
        steps, answer = row["response"].split(" #### ")
        partial = terms[0]
        for step, term in zip(steps.split(" , "), terms[1:], strict=True):
            assert step == f"{partial} + {term} = {partial + term}"
            partial += term
        assert answer == row["ground_truth"] == str(partial)


def test_response_lengths_have_a_long_tail(tokenizer):
    """Seed 1's 4000 rows counted with the tokenizer: median 7 tokens (2 terms), longest 91 (16 terms: 15 steps of 5
    tokens, 14 commas, '####' and the answer), 6k - 5 tokens for k terms."""
    rows = make_chain_dataset(4000, seed=1)
    lengths = [len(tokenizer(r["response"], add_special_tokens=False)["input_ids"]) for r in rows]
    assert all(n == 6 * len(r["extra_info"]["terms"]) - 5 for n, r in zip(lengths, rows))
    assert statistics.median(lengths) == 7 and max(lengths) == 91
    assert max(lengths) + 1 >= 10 * (statistics.median(lengths) + 1)  # with the EOS the trainer appends
    terms = [len(r["extra_info"]["terms"]) for r in rows]
    assert terms.count(2) == 2150 and terms.count(16) == 16  # 0.538 and 0.0040 of the rows; weights 0.533, 0.0030


def test_tokenizer_round_trips_the_longest_chain(tokenizer):
    # 15 words and specials, 0..200 (20 + 19 + ... + 5, the largest sum of 16 distinct terms), ','
    assert len(tokenizer) == len(arithmetic_vocab(20, "chain")) == 217
    assert arithmetic_vocab(20) == arithmetic_vocab(20, "arithmetic")  # the arithmetic task's ids are unchanged
    terms = list(range(20, 4, -1))
    for text in [format_chain_question(terms), format_chain_response(terms), format_chain_response([3, 5, 2])]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids and tokenizer.decode(ids) == text
    assert tokenizer("201", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]
    with pytest.raises(ValueError, match="16 distinct terms need max_operand >= 15"):
        make_chain_dataset(1, seed=0, max_operand=14)


def test_the_arithmetic_reward_scores_a_right_and_a_wrong_chain():
    rows = make_chain_dataset(20, seed=5)
    right = [RewardInput(r["data_source"], r["response"], r["ground_truth"], r["extra_info"]) for r in rows]
    scores, metrics, _ = compute_rewards(RewardRouter(), right, num_workers=0)
    assert scores == [1.0] * 20 and metrics["acc"] == [1.0] * 20
    wrong = RewardInput("arithmetic", "3 + 5 = 8 , 8 + 2 = 11 #### 11", "10", {})
    slip = RewardInput("arithmetic", "3 + 5 = 9 , 9 + 2 = 11 #### 10", "10", {})  # only the final answer counts
    scores, metrics, _ = compute_rewards(RewardRouter(), [wrong, slip], num_workers=0)
    assert scores == [0.0, 1.0] and metrics["formatted"] == [1.0, 1.0]


def test_validate_bounds_the_chain_vocabulary():
    def issues(max_operand):
        cfg = MegarlConfig.model_validate({"data": {"synthetic": {"task": "chain", "max_operand": max_operand}}})
        return check_synthetic(cfg)

    assert issues(15) == issues(25) == []  # 25: sums up to 280, 297 tokens
    for bad in (14, 26):  # 14: too few distinct terms; 26: sums up to 296, 313 tokens
        [issue] = issues(bad)
        assert issue.key == "data.synthetic.max_operand" and issue.value == bad and "15 to 25" in issue.fix


def test_validate_refuses_slips_where_no_demonstration_would_have_them():
    def issues(**synthetic):
        return check_synthetic(MegarlConfig.model_validate({"data": {"synthetic": synthetic}}))

    assert issues(task="chain", num_sft=100, slip_share=0.2) == []
    [issue] = issues(task="arithmetic", num_sft=100, slip_share=0.2)
    assert issue.key == "data.synthetic.slip_share" and "task: chain" in issue.fix
    [issue] = issues(task="chain", slip_share=0.2)  # SFT would read the training prompts' exact answers
    assert issue.key == "data.synthetic.slip_share" and "num_sft" in issue.fix


def test_the_recipe_writes_slips_into_the_sft_file_only(tmp_path):
    from pathlib import Path

    from megarl.config.outputs import synthetic_paths
    from megarl.data import read_rows
    from megarl.prepare import write_synthetic_data
    from megarl.validate import load_config

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "grpo_longtail_cp2_tiny_cpu.yaml"
    cfg = load_config(recipe, [f"trainer.run_dir={tmp_path}", "data.synthetic.num_train=200",
                               "data.synthetic.num_val=50", "data.synthetic.num_sft=200"])
    write_synthetic_data(cfg)
    rows = {split: read_rows(str(path)) for split, path in synthetic_paths(cfg).items()}
    assert sum(r["extra_info"]["slips"] for r in rows["sft"]) > 0
    assert sum(r["extra_info"]["slips"] for r in rows["train"] + rows["val"]) == 0
