"""The walk task: a scratchpad of 125 to 500 steps (responses of 1-4k tokens), its tokenizer's exact round trip, its
slipping demonstrator, and the walk reward checking every step."""
import statistics

import pytest

from megarl.config.schema import MegarlConfig
from megarl.data.checks import check_synthetic
from megarl.data.synthetic_walk import (format_walk_question, format_walk_response, make_walk_dataset, walk_tokenizer,
                                        walk_values)
from megarl.reward import RewardInput, RewardRouter, compute_rewards
from megarl.reward.rules import walk


def test_a_hand_example_of_question_and_worked_walk():
    assert format_walk_question(7, 5, 300) == "Walk from 7 by 5 for 300 steps ?"
    # 17 + 5 = 22 -> 2 on a clock of 20; then 2 + 5 = 7
    assert walk_values(17, 5, 2) == [2, 7]
    assert format_walk_response(17, 5, 2) == "2 : 17 + 5 = 2 , 1 : 2 + 5 = 7 #### 7"
    # a slip writes one more and the walk goes on from it
    assert format_walk_response(17, 5, 2, slips=[1, 0]) == "2 : 17 + 5 = 3 , 1 : 3 + 5 = 8 #### 8"


def test_rows_are_1_to_4k_tokens_and_slips_fall_on_wraps_only():
    exact, sloppy = make_walk_dataset(400, seed=3), make_walk_dataset(400, seed=3, slip_share=0.6)
    assert [r["prompt"] for r in exact] == [r["prompt"] for r in sloppy]
    steps = [r["extra_info"]["steps"] for r in exact]
    assert min(steps) >= 125 and max(steps) <= 500
    # log-uniform on [125, 501): median 125 * 4.008 ** 0.5 = 250, mean 376 / ln(4.008) = 271
    assert 230 <= statistics.median(steps) <= 270 and 255 <= statistics.mean(steps) <= 290
    wraps = slips = 0
    for row in sloppy:
        info = row["extra_info"]
        pieces = row["response"].split(" #### ")[0].split(" , ")
        assert len(pieces) == info["steps"]
        before = info["start"]
        for piece in pieces:
            _, _, b, _, d, _, v = piece.split()[:7]
            b, d, v = int(b), int(d), int(v)
            assert b == before and d == info["stride"]
            if b + d >= 20:
                wraps += 1
                slips += v != (b + d) % 20
            else:
                assert v == b + d  # no slip off a wrap
            before = v
    assert 0.55 <= slips / wraps <= 0.65
    assert all(r["ground_truth"] == r["response"].split()[-1] for r in exact)


def test_tokenizer_round_trips_the_longest_walk(tmp_path):
    from transformers import AutoTokenizer

    walk_tokenizer(str(tmp_path))
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    text = format_walk_response(19, 9, 500)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids and tok.decode(ids) == text
    assert len(ids) == 8 * 500 + 1  # 8 tokens a step, less the last comma, plus '####' and the end
    assert tok("501", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]


def info(start, stride, steps):
    return {"start": start, "stride": stride, "steps": steps}


def test_the_walk_reward_checks_every_step_against_the_one_before():
    right = walk("walk", "2 : 17 + 5 = 2 , 1 : 2 + 5 = 7 #### 7", "7", info(17, 5, 2))
    assert right == {"score": 1.0, "acc": 1.0, "steps_right": 1.0, "wraps_right": 1.0}
    # the wrap slipped (3, not 2); the second step goes on right from what was written, the ending repeats it
    slipped = walk("walk", "2 : 17 + 5 = 3 , 1 : 3 + 5 = 8 #### 8", "7", info(17, 5, 2))
    assert slipped == {"score": 2 / 3, "acc": 0.0, "steps_right": 0.5, "wraps_right": 0.0}
    # a step that does not go on from the one before is wrong even when its own sum is right
    jumped = walk("walk", "2 : 17 + 5 = 2 , 1 : 4 + 5 = 9 #### 9", "7", info(17, 5, 2))
    assert jumped["score"] == 2 / 3 and jumped["steps_right"] == 0.5
    # a wrong countdown, a truncated answer (no ending), one step too many, an ending that is not the last value
    assert walk("walk", "2 : 17 + 5 = 2 , 2 : 2 + 5 = 7 #### 7", "7", info(17, 5, 2))["score"] == 2 / 3
    assert walk("walk", "2 : 17 + 5 = 2 , 1 : 2 + 5", "7", info(17, 5, 2))["score"] == 1 / 3
    assert walk("walk", "2 : 17 + 5 = 2 , 1 : 2 + 5 = 7 , 0 : 7 + 5 = 12 #### 12", "7", info(17, 5, 2))["score"] == 2 / 3
    assert walk("walk", "2 : 17 + 5 = 2 , 1 : 2 + 5 = 7 #### 8", "7", info(17, 5, 2))["score"] == 2 / 3
    assert walk("walk", "#### 7", "7", info(17, 5, 2))["score"] == 0.0
    with pytest.raises(ValueError, match="start, stride and steps"):
        walk("walk", "#### 7", "7", {})


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
