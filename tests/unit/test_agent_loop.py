"""The agent loop against a scripted model (an agenerate with the engine's signature that answers from a script):
token-exact trajectories, the loss mask, turn and budget limits, error responses, and the sanity check's zero drift
on the tiny task's tokenizer and on a byte-level BPE tokenizer with a Qwen2.5-style template built here."""
import asyncio
import re

import pytest
import torch

from megarl.agent.loop import TURN_SEED_STRIDE, AgentRollout, trajectory_counts, trajectory_tensors, tool_rates
from megarl.agent.tools import load_tools
from megarl.config.schema import MultiTurnConfig, RolloutConfig
from megarl.rollout.requests import Completion

CALC_YAML = """
tools:
  - function: recipes/tools/calculator.py:calculator
    timeout_s: 5
    schema:
      type: function
      function:
        name: calculator
        description: calculator
        parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""

QWEN_LIKE_TEMPLATE = (
    "{%- if messages[0].role != 'system' %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role in ['user', 'system', 'assistant'] %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


@pytest.fixture(scope="module")
def multiply_tok(tmp_path_factory):
    from megarl.data.synthetic_tool import multiply_tokenizer

    return multiply_tokenizer(str(tmp_path_factory.mktemp("mtok")))


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory):
    """A byte-level BPE tokenizer (merges learned from a small corpus) with a Qwen2.5-style chat template."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [f"What is {a} * {b} ? The calculator says {a * b}. Call the tool with an expression please."
              for a in range(10, 60) for b in range(3, 9)] * 2
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.train_from_iterator(corpus, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t in ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=QWEN_LIKE_TEMPLATE, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    assert len(tok.get_vocab()) > 300 and tok.model.__class__.__name__ == "BPE"
    return fast


def _config(tmp_path, response_length=64, **mt):
    (tmp_path / "tools.yaml").write_text(CALC_YAML)
    multi = MultiTurnConfig(enable=True, tool_config_path=str(tmp_path / "tools.yaml"), sanity_check=True, **mt)
    return RolloutConfig(response_length=response_length, multi_turn=multi)


class ScriptedModel:
    """agenerate(prompt_ids, sampling, n, seed) answering turn k of a conversation with script(question, k); the
    sampled ids are the tokenizer's encoding of the text plus the stop token, each with logprob -(1 + position)/100."""

    def __init__(self, tok, script):
        self.tok, self.script, self.calls = tok, script, []

    async def agenerate(self, prompt_ids, sampling, n=1, seed=None):
        text = self.tok.decode(prompt_ids, skip_special_tokens=False)
        question = re.search(r"What is (\d+) \* (\d+)", text).groups()
        turn = text.count("<|assistant|>") + text.count("<|im_start|>assistant") - 1
        self.calls.append((len(prompt_ids), sampling["max_tokens"], seed))
        ids = self.tok.encode(self.script(question, turn), add_special_tokens=False) + [self.tok.eos_token_id]
        reason = "stop"
        if len(ids) > sampling["max_tokens"]:
            ids, reason = ids[:sampling["max_tokens"]], "length"
        await asyncio.sleep(0)
        return [Completion(ids, [-(1 + i) / 100 for i in range(len(ids))], reason)]


def _calc_call(expr):
    return '<tool_call>{"name":"calculator","arguments":{"expression":"' + expr + '"}}</tool_call>'


def _solver(question, turn):
    a, b = question
    return _calc_call(f"{a}*{b}") if turn == 0 else "#### " + str(int(a) * int(b))


def _prompt(tok, a, b):
    out = tok.apply_chat_template([{"role": "user", "content": f"What is {a} * {b} ?"}], add_generation_prompt=True,
                                  tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _rollout(tok, cfg, script, prompts, n=1):
    agent = AgentRollout(cfg, tok, load_tools(cfg.multi_turn.tool_config_path))
    model = ScriptedModel(tok, script)
    seeds = [100 + i for i in range(len(prompts) * n)]
    trajs = asyncio.run(agent.run(model.agenerate, prompts, n, {"temperature": 1.0}, seeds))
    return trajs, model


@pytest.mark.parametrize("tok_name", ["multiply_tok", "bpe_tok"])
def test_trajectory_is_the_concatenation_with_mask_and_zero_drift(request, tmp_path, tok_name):
    tok = request.getfixturevalue(tok_name)
    cfg = _config(tmp_path, response_length=128)
    trajs, model = _rollout(tok, cfg, _solver, [_prompt(tok, 37, 48), _prompt(tok, 12, 34)])
    t = trajs[0]
    turn1 = tok.encode(_calc_call("37*48"), add_special_tokens=False) + [tok.eos_token_id]
    turn2 = tok.encode("#### 1776", add_special_tokens=False) + [tok.eos_token_id]
    # the tool turn, rendered independently: the full conversation's text between the two assistant contents
    conv = [{"role": "user", "content": "What is 37 * 48 ?"}, {"role": "assistant", "content": _calc_call("37*48")},
            {"role": "tool", "content": "1776"}, {"role": "assistant", "content": "#### 1776"}]
    full = tok.apply_chat_template(conv, tokenize=False)
    between = full[full.index("</tool_call>") + len("</tool_call>"):full.index("#### 1776")]
    tool_ids = tok.encode(between, add_special_tokens=False)[1:]  # the model already sampled the stop token
    assert t.response_ids == turn1 + tool_ids + turn2
    assert t.mask == [1] * len(turn1) + [0] * len(tool_ids) + [1] * len(turn2)
    assert t.logprobs == [-(1 + i) / 100 for i in range(len(turn1))] + [0.0] * len(tool_ids) + \
        [-(1 + i) / 100 for i in range(len(turn2))]
    assert "1776" in tok.decode(tool_ids) and t.finish_reason == "stop"
    assert (t.assistant_turns, t.tool_turns, t.calls, t.ok_calls) == (2, 1, 1, 1)
    assert t.drift is False and trajs[1].drift is False
    # the second turn's budget is what the first turn and the tool turn left; its seed is the turn's
    done = len(turn1) + len(tool_ids)
    assert (len(_prompt(tok, 37, 48)) + done, 128 - done, 100 + TURN_SEED_STRIDE) in model.calls
    m = trajectory_counts(trajs)
    assert (m["tool/calls"], m["tool/sanity_checked"], m["tool/sanity_drift"]) == (2, 2, 0)
    assert tool_rates(m)["tool/turns_mean"] == 2.0


def test_sanity_check_counts_drift(bpe_tok, tmp_path):
    """A model turn sampled as another split of its text than the tokenizer's own (one token per character of
    'calculator', which the BPE merges) is the model's choice, not drift. A template whose tool turn depends on the
    earlier conversation (it numbers tool turns by the assistant messages before them) renders the second tool turn
    differently from the loop's placeholder rendering: drift, and counted."""
    tok = bpe_tok
    cfg = _config(tmp_path, response_length=200)
    agent = AgentRollout(cfg, tok, load_tools(cfg.multi_turn.tool_config_path))
    chars = [i for c in "calculator" for i in tok.encode(c, add_special_tokens=False)]
    assert chars != tok.encode("calculator", add_special_tokens=False)

    async def odd_model(prompt_ids, sampling, n=1, seed=None):
        return [Completion(chars + [tok.eos_token_id], [-0.1] * (len(chars) + 1), "stop")]

    trajs = asyncio.run(agent.run(odd_model, [_prompt(tok, 1, 2)], 1, {}, [None]))
    assert trajs[0].drift is False

    from megarl.data.synthetic_tool import CHAT_TEMPLATE, multiply_tokenizer

    counting = multiply_tokenizer(str(tmp_path / "counting"))
    counting.chat_template = CHAT_TEMPLATE.replace(
        "'<|' + message['role'] + '|>'",
        "'<|' + message['role'] + '|>' + ((messages[:loop.index0] | selectattr('role', 'eq', 'assistant') | list "
        "| length | string) if message['role'] == 'tool' else '')")
    agent = AgentRollout(cfg, counting, load_tools(cfg.multi_turn.tool_config_path))
    calls_twice = lambda q, turn: _calc_call("2*3") if turn < 2 else "#### 6"  # noqa: E731
    model = ScriptedModel(counting, calls_twice)
    trajs = asyncio.run(agent.run(model.agenerate, [_prompt(counting, 1, 2)], 1, {}, [None]))
    assert trajs[0].tool_turns == 2 and trajs[0].drift is True
    assert trajectory_counts(trajs)["tool/sanity_drift"] == 1


@pytest.mark.parametrize("turn0,kind", [
    ('<tool_call>{"name":"calculator","arguments":{"expression":"1*2"</tool_call>', "parse"),
    ('<tool_call>{"name":"calc","arguments":{"expression":"1*2"}}</tool_call>', "unknown_tool"),
    ('<tool_call>{"name":"calculator","arguments":{"expr":"1*2"}}</tool_call>', "bad_arguments"),
    (_calc_call("1/0"), "exception"),
])
def test_bad_call_gives_the_model_an_error_and_the_run_goes_on(multiply_tok, tmp_path, turn0, kind):
    tok = multiply_tok
    cfg = _config(tmp_path, response_length=200)
    trajs, _ = _rollout(tok, cfg, lambda q, turn: turn0 if turn == 0 else "#### 2", [_prompt(tok, 1, 2)])
    t = trajs[0]
    assert t.errors == {kind: 1} and t.assistant_turns == 2 and t.finish_reason == "stop"
    tool_part = [i for i, m in zip(t.response_ids, t.mask) if m == 0]
    assert tok.decode(tool_part, skip_special_tokens=True).startswith("Err")  # 'Error: ...' (the tool turn's text)
    assert trajectory_counts(trajs)[f"tool/errors/{kind}"] == 1


def test_turn_limits_budget_and_parallel_calls(multiply_tok, tmp_path):
    tok = multiply_tok
    always_call = lambda q, turn: _calc_call("2*3")  # noqa: E731 - never answers
    trajs, _ = _rollout(tok, _config(tmp_path, response_length=400, max_assistant_turns=3), always_call,
                        [_prompt(tok, 1, 2)])
    assert (trajs[0].assistant_turns, trajs[0].tool_turns, trajs[0].truncated_by_max_turns) == (3, 2, True)
    trajs, _ = _rollout(tok, _config(tmp_path, response_length=400, max_user_turns=1), always_call,
                        [_prompt(tok, 1, 2)])
    assert (trajs[0].assistant_turns, trajs[0].tool_turns, trajs[0].truncated_by_max_turns) == (2, 1, True)
    # budget: the call (28 tokens with its stop token) fits; the tool turn (4 tokens) would leave no room for the
    # model: not appended. One token more and it is, and the next model turn gets that one token.
    call = len(tok.encode(_calc_call("2*3"), add_special_tokens=False)) + 1
    trajs, _ = _rollout(tok, _config(tmp_path, response_length=call + 4), always_call, [_prompt(tok, 1, 2)])
    t = trajs[0]
    assert (t.finish_reason, t.truncated_by_budget, t.tool_turns, sum(t.mask), len(t.response_ids)) == \
        ("length", True, 0, call, call)
    trajs, model = _rollout(tok, _config(tmp_path, response_length=call + 5), always_call, [_prompt(tok, 1, 2)])
    t = trajs[0]
    assert (t.finish_reason, t.tool_turns, t.mask, model.calls[-1][1]) == ("length", 1, [1] * call + [0] * 4 + [1], 1)
    # a model turn cut by the budget ends the trajectory with finish_reason length
    trajs, _ = _rollout(tok, _config(tmp_path, response_length=10), always_call, [_prompt(tok, 1, 2)])
    assert (trajs[0].finish_reason, len(trajs[0].response_ids)) == ("length", 10)
    two = lambda q, turn: (_calc_call("2*3") + _calc_call("4*5") + _calc_call("1+1")) if turn == 0 else "#### 6"  # noqa
    trajs, _ = _rollout(tok, _config(tmp_path, response_length=400, max_parallel_calls=2), two, [_prompt(tok, 1, 2)])
    t = trajs[0]
    assert t.calls == 3 and t.ok_calls == 2 and t.errors == {"too_many_calls": 1}
    text = tok.decode([i for i, m in zip(t.response_ids, t.mask) if m == 0], skip_special_tokens=True)
    assert text.startswith("6") and "20" in text


def test_trajectories_are_in_flight_together_and_tensors(multiply_tok, tmp_path):
    """Every trajectory's turn is requested before any is answered (one engine serves them all at once), and the
    padded tensors carry each trajectory's ids and mask."""
    tok = multiply_tok
    cfg = _config(tmp_path)
    agent = AgentRollout(cfg, tok, load_tools(cfg.multi_turn.tool_config_path))
    model = ScriptedModel(tok, _solver)
    waiting, rounds = [], []

    async def agenerate(prompt_ids, sampling, n=1, seed=None):
        event = asyncio.Event()
        waiting.append(event)
        if len(waiting) == 12:  # the last of the 12 trajectories asked: answer them all
            rounds.append(len(waiting))
            for e in waiting:
                e.set()
            waiting.clear()
        await event.wait()
        return await model.agenerate(prompt_ids, sampling, n, seed)

    prompts = [_prompt(tok, 40 + i, 50 + i) for i in range(6)]
    trajs = asyncio.run(asyncio.wait_for(agent.run(agenerate, prompts, 2, {}, [None] * 12), 30))
    assert rounds == [12, 12]  # first turns together, then second turns together (tools ran concurrently)
    t = trajectory_tensors(trajs, pad=0)
    lengths = t["response_lengths"]
    assert t["response_ids"].shape == (12, int(lengths.max()))
    for i, tr in enumerate(trajs):
        assert t["response_ids"][i, :len(tr.response_ids)].tolist() == tr.response_ids
        assert t["loss_mask"][i, :len(tr.mask)].tolist() == [bool(m) for m in tr.mask]
        assert not t["loss_mask"][i, len(tr.mask):].any()
    assert torch.equal(t["tool_rewards"], torch.zeros(12))


def test_timeout_and_http_errors_reach_the_model(multiply_tok, tmp_path):
    tok = multiply_tok
    (tmp_path / "slow.py").write_text("import time\ndef slow(expression):\n    time.sleep(3)\n    return '1'\n")
    (tmp_path / "tools.yaml").write_text(CALC_YAML + f"""
  - function: {tmp_path}/slow.py:slow
    timeout_s: 0.2
    schema: {{type: function, function: {{name: What, parameters: {{type: object, properties: {{expression: {{type: string}}}}}}}}}}
  - url: http://127.0.0.1:9/none
    timeout_s: 2
    schema: {{type: function, function: {{name: is, parameters: {{type: object, properties: {{expression: {{type: string}}}}}}}}}}
""")
    cfg = RolloutConfig(response_length=400, multi_turn=MultiTurnConfig(
        enable=True, tool_config_path=str(tmp_path / "tools.yaml"), max_parallel_calls=2))
    call = '<tool_call>{"name":"%s","arguments":{"expression":"1"}}</tool_call>'
    # tool names from the tiny vocabulary's words: 'What' sleeps past its timeout, 'is' has no server
    trajs, _ = _rollout(tok, cfg, lambda q, turn: (call % "What" + call % "is") if turn == 0 else "#### 1",
                        [_prompt(tok, 1, 2)])
    t = trajs[0]
    assert t.errors == {"timeout": 1, "http": 1} and t.assistant_turns == 2 and t.finish_reason == "stop"
    counts = trajectory_counts(trajs)
    assert (counts["tool/errors/timeout"], counts["tool/errors/http"], tool_rates(counts)["tool/error_rate"]) == \
        (1, 1, 1.0)
