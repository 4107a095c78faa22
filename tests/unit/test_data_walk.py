"""The walk task: a scratchpad of 170 to 666 steps (responses of 1-4k tokens), its tokenizer's exact round trip, its
slipping demonstrator, and the walk reward checking every step."""
import statistics

import pytest

from megarl.config.schema import MegarlConfig
from megarl.data.checks import check_synthetic
from megarl.data.synthetic_walk import (format_walk_question, format_walk_response, make_walk_dataset, spell,
                                        walk_tokenizer, walk_values)
from megarl.reward import RewardInput, RewardRouter, compute_rewards
from megarl.reward.rules import walk


def test_a_hand_example_of_question_and_worked_walk():
    assert format_walk_question(7, 347) == "Walk from 7 for 3 4 7 steps ?"
    assert spell(47) == "0 4 7"
    # 8 + 3 = 11 -> 1 on a clock of 10; then 1 + 3 = 4
    assert walk_values(8, 2) == [1, 4]
    assert format_walk_response(8, 2) == "0 0 2 : 1 , 0 0 1 : 4 #### 4"
    # a slip writes one more and the walk goes on from it
    assert format_walk_response(8, 2, slips=[1, 0]) == "0 0 2 : 2 , 0 0 1 : 5 #### 5"
    # the countdown borrows across digits: 101, 100, 099
    assert format_walk_response(0, 101).startswith("1 0 1 : 3 , 1 0 0 : 6 , 0 9 9 : 9 , 0 9 8 : 2 ,")
    with pytest.raises(ValueError, match="3 digits"):
        spell(1000)


def test_rows_are_1_to_4k_tokens_and_slips_fall_on_wraps_only():
    exact, sloppy = make_walk_dataset(400, seed=3), make_walk_dataset(400, seed=3, slip_share=0.6)
    assert [r["prompt"] for r in exact] == [r["prompt"] for r in sloppy]
    steps = [r["extra_info"]["steps"] for r in exact]
    assert min(steps) >= 170 and max(steps) <= 666
    # log-uniform on [170, 667): median 170 * (667 / 170) ** 0.5 = 337, mean 497 / ln(667 / 170) = 364
    assert 310 <= statistics.median(steps) <= 365 and 340 <= statistics.mean(steps) <= 390
    wraps = slips = 0
    for row in sloppy:
        info = row["extra_info"]
        pieces = row["response"].split(" #### ")[0].split(" , ")
        assert len(pieces) == info["steps"]
        before = info["start"]
        for k, piece in enumerate(pieces):
            h, t, o, colon, v = piece.split()
            assert int(h + t + o) == info["steps"] - k and colon == ":"
            v = int(v)
            if before + 3 >= 10:
                wraps += 1
                slips += v != (before + 3) % 10
                assert v in ((before + 3) % 10, (before + 4) % 10)
            else:
                assert v == before + 3  # no slip off a wrap
            before = v
    assert 0.55 <= slips / wraps <= 0.65
    assert all(r["ground_truth"] == r["response"].split()[-1] for r in exact)


def test_tokenizer_round_trips_the_longest_walk(tmp_path):
    from transformers import AutoTokenizer

    walk_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = format_walk_response(9, 666)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert len(ids) == 6 * 666 + 1  # 6 tokens a step, less the last comma, plus '####' and the end
    question = format_walk_question(9, 666)
    assert tok.decode(tok(question, add_special_tokens=False)["input_ids"]) == question


def info(start, steps):
    return {"start": start, "steps": steps}


def test_the_walk_reward_checks_every_step_against_the_one_before():
    right = walk("walk", "0 0 2 : 1 , 0 0 1 : 4 #### 4", "4", info(8, 2))
    assert right == {"score": 1.0, "acc": 1.0, "steps_right": 1.0, "wraps_right": 1.0}
    # the wrap slipped (2, not 1); the second step goes on right from what was written, the ending repeats it
    slipped = walk("walk", "0 0 2 : 2 , 0 0 1 : 5 #### 5", "4", info(8, 2))
    assert slipped == {"score": 2 / 3, "acc": 0.0, "steps_right": 0.5, "wraps_right": 0.0}
    # a step that does not go on from the one before is wrong even when it is the true walk's value
    assert walk("walk", "0 0 2 : 2 , 0 0 1 : 4 #### 4", "4", info(8, 2))["score"] == 1 / 3
    # the countdown is checked the same way: a miscounted step costs that step, and the ending when it ends off 1
    assert walk("walk", "0 0 2 : 1 , 0 0 2 : 4 #### 4", "4", info(8, 2))["score"] == 1 / 3
    assert walk("walk", "0 0 3 : 1 , 0 0 1 : 4 , 0 0 0 : 7 #### 7", "7", info(8, 3))["score"] == 2 / 4
    assert walk("walk", "0 0 4 : 1 , 0 0 3 : 4 , 0 0 2 : 7 #### 7", "7", info(8, 3))["score"] == 2 / 4
    # a truncated answer (no ending), one step too many, an ending that is not the last value
    assert walk("walk", "0 0 2 : 1 , 0 0 1 :", "4", info(8, 2))["score"] == 1 / 3
    assert walk("walk", "0 0 2 : 1 , 0 0 1 : 4 , 0 0 0 : 7 #### 7", "4", info(8, 2))["score"] == 2 / 3
    assert walk("walk", "0 0 2 : 1 , 0 0 1 : 4 #### 5", "4", info(8, 2))["score"] == 2 / 3
    assert walk("walk", "#### 4", "4", info(8, 2))["score"] == 0.0
    with pytest.raises(ValueError, match="start and steps"):
        walk("walk", "#### 4", "4", {})


def test_generated_rows_score_by_their_data_source():
    rows = make_walk_dataset(6, seed=1) + make_walk_dataset(6, seed=1, slip_share=0.9)
    inputs = [RewardInput(r["data_source"], r["response"], r["ground_truth"], r["extra_info"]) for r in rows]
    scores, metrics, _ = compute_rewards(RewardRouter(), inputs, num_workers=0)
    assert scores[:6] == [1.0] * 6 and metrics["acc"][:6] == [1.0] * 6
    for score, row in zip(scores[6:], rows[6:]):
        steps, slips = row["extra_info"]["steps"], row["extra_info"]["slips"]
        assert slips > 0 and score == pytest.approx((steps - slips + 1) / (steps + 1))


def test_validate_lets_the_walk_demonstrator_slip():
    def issues(**synthetic):
        return check_synthetic(MegarlConfig.model_validate({"data": {"synthetic": synthetic}}))

    assert issues(task="walk", num_sft=100, slip_share=0.6) == []
    [issue] = issues(task="walk", slip_share=0.6)
    assert issue.key == "data.synthetic.slip_share" and "num_sft" in issue.fix
