"""The multiply_tool task: its tokenizer decodes to the exact text it encoded, its SFT demonstrations are the token
sequences the agent loop produces for a correct trajectory, and its reward reads answers and calls."""
import asyncio

import pytest

from megarl.agent.loop import AgentRollout
from megarl.agent.tools import load_tools
from megarl.config.schema import MultiTurnConfig, RolloutConfig
from megarl.data.synthetic_tool import make_multiply_dataset, multiply_tokenizer, tool_call_text
from megarl.reward.rules import multiply_tool
from megarl.rollout.requests import Completion


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return multiply_tokenizer(str(tmp_path_factory.mktemp("tok")))


def test_rows_are_reproducible_and_four_digit():
    rows = make_multiply_dataset(50, seed=3)
    assert rows == make_multiply_dataset(50, seed=3) and rows != make_multiply_dataset(50, seed=4)
    for r in rows:
        a, b = r["extra_info"]["a"], r["extra_info"]["b"]
        assert 32 <= a <= 99 and 32 <= b <= 99 and r["ground_truth"] == str(a * b) and len(r["ground_truth"]) == 4


def test_tokenizer_round_trip(tok):
    row = make_multiply_dataset(1, seed=0)[0]
    text = tok.apply_chat_template(row["prompt"] + row["response"], tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.unk_token_id not in ids and tok.decode(ids, skip_special_tokens=False) == text
    call = tool_call_text(37, 48)
    assert tok.decode(tok.encode(call, add_special_tokens=False)) == call  # JSON survives exactly


def test_demonstration_is_what_the_loop_builds(tok, tmp_path):
    """SFT teaches exactly the ids a correct trajectory has (the prompt, the model's call, the loop's tool turn, the
    answer and EOS), and trains only the ids the model samples there (the loop's loss mask)."""
    from megarl.data import records_from_rows
    from megarl.sft import encode_sft, sft_batch

    row = make_multiply_dataset(1, seed=5)[0]
    a, b = row["extra_info"]["a"], row["extra_info"]["b"]
    (tmp_path / "t.yaml").write_text(
        "tools:\n  - function: recipes/tools/calculator.py:calculator\n    schema: {type: function, function: "
        "{name: calculator, parameters: {type: object, properties: {expression: {type: string}}}}}\n")
    cfg = RolloutConfig(response_length=64, multi_turn=MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "t.yaml")))
    turns = [tool_call_text(a, b), f"#### {a * b}"]

    async def model(prompt_ids, sampling, n=1, seed=None):
        ids = tok.encode(turns.pop(0), add_special_tokens=False) + [tok.eos_token_id]
        return [Completion(ids, [0.0] * len(ids), "stop")]

    prompt = tok.encode(tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False),
                        add_special_tokens=False)
    agent = AgentRollout(cfg, tok, load_tools(cfg.multi_turn.tool_config_path))
    traj = asyncio.run(agent.run(model, [prompt], 1, {}, [None]))[0]
    [(ids, mask, _)] = encode_sft(records_from_rows([row], "demo", require_response=True), tok, 128, True)
    assert ids == prompt + traj.response_ids
    assert mask == [0] * len(prompt) + traj.mask
    batch = sft_batch([(ids, mask)], pad_id=0)
    assert batch["response_mask"][0].tolist() == [bool(m) for m in mask[1:]]


def test_reward():
    call = tool_call_text(37, 48)
    assert multiply_tool("multiply_tool", call + "1776#### 1776", "1776") == \
        {"score": 1.0, "acc": 1.0, "formatted": 1.0, "correct_call": 1.0}
    assert multiply_tool("multiply_tool", tool_call_text(37, 49) + "1813#### 1813", "1776")["score"] == 0.0
    assert multiply_tool("multiply_tool", "#### 1776", "1776")["correct_call"] == 0.0
    assert multiply_tool("multiply_tool", call + "1776", "1776") == \
        {"score": 0.0, "acc": 0.0, "formatted": 0.0, "correct_call": 1.0}


def test_plain_sft_target_trains_the_response_and_eos(tok):
    from megarl.data import records_from_rows
    from megarl.sft import encode_sft, sft_batch

    row = {"prompt": [{"role": "user", "content": "What is 40 * 50 ?"}], "response": "#### 2000", "data_source": "x",
           "ground_truth": "2000"}
    [(ids, mask, _)] = encode_sft(records_from_rows([row], "plain", require_response=True), tok, 128, True)
    prompt = tok.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
    p = len(tok.encode(prompt, add_special_tokens=False))
    assert ids == tok.encode(prompt + "#### 2000", add_special_tokens=False) + [tok.eos_token_id]
    assert mask == [0] * p + [1] * (len(ids) - p)
    m = sft_batch([(ids, mask)], pad_id=0)["response_mask"][0]
    assert m.nonzero().flatten().tolist() == list(range(p - 1, len(ids) - 1))  # position t predicts token t+1


def test_direct_answer_share_keeps_the_questions_and_drops_the_tool():
    """The share changes only whether a demonstration calls the tool: the same questions, the same answers; about the
    share of rows (binomial: 1000 rows at 0.5 have sd 15.8, so 5 sd is 79) answer at once."""
    base = make_multiply_dataset(1000, seed=7)
    mixed = make_multiply_dataset(1000, seed=7, direct_answer_share=0.5)
    assert [r["prompt"] for r in base] == [r["prompt"] for r in mixed]
    assert [r["ground_truth"] for r in base] == [r["ground_truth"] for r in mixed]
    direct = [r for r in mixed if len(r["response"]) == 1]
    assert 500 - 79 <= len(direct) <= 500 + 79
    for r in direct:
        assert r["response"] == [{"role": "assistant", "content": f"#### {r['ground_truth']}"}]
    assert all(r["response"] == b["response"] for r, b in zip(mixed, base) if len(r["response"]) == 3)
    with pytest.raises(ValueError, match="direct_answer_share"):
        make_multiply_dataset(1, seed=0, direct_answer_share=1.0)


def test_direct_answer_share_is_refused_on_the_arithmetic_task():
    from megarl.config.schema import MegarlConfig
    from megarl.data.checks import check_synthetic

    cfg = MegarlConfig.model_validate({"data": {"synthetic": {"task": "arithmetic", "direct_answer_share": 0.3}}})
    [issue] = check_synthetic(cfg)
    assert issue.key == "data.synthetic.direct_answer_share" and "multiply_tool" in issue.fix
    cfg = MegarlConfig.model_validate({"data": {"synthetic": {"task": "multiply_tool", "max_operand": 99,
                                                              "direct_answer_share": 0.3}}})
    assert check_synthetic(cfg) == []
