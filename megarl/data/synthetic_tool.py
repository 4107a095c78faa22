"""A synthetic task that needs a tool: multiply two numbers with a `calculator` (the multi-turn tiny CPU demo).

    prompt        [{"role": "user", "content": "What is 37 * 48 ?"}]   (operands in [32, 99]: 4-digit products)
    demonstration assistant  <tool_call>{"name":"calculator","arguments":{"expression":"37*48"}}</tool_call>
                  tool       1776
                  assistant  #### 1776
    ground_truth  "1776", data_source "multiply_tool" (scored by the `arithmetic` reward)

Numbers are written digit by digit (one token per digit), so a tiny model cannot produce a 4-digit product itself,
but it can learn to copy the operands into a call and the tool's answer into its reply. The tokenizer is
character-level for JSON and digits with whole-word tokens for the few words, and decodes to exactly the text it
encoded (tool-call JSON included), which the agent loop's parser and the sanity check rely on.
"""
from __future__ import annotations

import json
import random
from typing import Any

from megarl.data.synthetic import save_fast_tokenizer

DATA_SOURCE = "multiply_tool"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>"]
CALL_TOKENS = ["<tool_call>", "</tool_call>"]  # ordinary (not special) tokens: decoding keeps them, as in Qwen2.5
WORDS = ["What", "is", "name", "arguments", "calculator", "expression", "####", "Error"]
CHARS = list("0123456789") + list(" {}\":,*?+-/().=")

# "<s><|user|>What is 37 * 48 ?</s><|assistant|>"; every turn ends with EOS, the model's stop token
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def tool_call_text(a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": f"{a}*{b}"}},
                                      separators=(",", ":")) + "</tool_call>"


def make_multiply_dataset(n: int, seed: int, min_operand: int = 32, max_operand: int = 99,
                          split: str = "train", direct_answer_share: float = 0.0) -> list[dict[str, Any]]:
    """n rows of "What is a * b ?" with a, b uniform in [min_operand, max_operand] (the default 32..99 gives
    four-digit products, so every digit the model copies sits at a fixed distance from its source). `response` is the
    demonstration after the prompt as messages (call, tool response, answer): SFT trains the assistant turns and
    takes the tool turn as context. A `direct_answer_share` of the demonstrations answer at once, without the tool
    (a demonstrator who knows the product): a model that cannot multiply imitates a policy that calls the tool only
    that often, which RL then has to correct."""
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
    if not 0 <= direct_answer_share < 1:
        raise ValueError(f"need 0 <= direct_answer_share < 1, got {direct_answer_share}")
    rng = random.Random(f"megarl-multiply-tool:{seed}")
    # its own stream, so the operands of a seed stay the same whatever the share
    direct_rng = random.Random(f"megarl-multiply-tool-direct:{seed}")
    rows = []
    for i in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        response = [{"role": "assistant", "content": tool_call_text(a, b)}, {"role": "tool", "content": str(a * b)},
                    {"role": "assistant", "content": f"#### {a * b}"}]
        if direct_answer_share and direct_rng.random() < direct_answer_share:
            response = response[-1:]
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"What is {a} * {b} ?"}],
                     "response": response, "ground_truth": str(a * b),
                     "extra_info": {"index": i, "split": split, "a": a, "b": b}})
    return rows


def multiply_vocab() -> list[str]:
    """Token strings in id order: specials (<pad>=0, <s>=1, </s>=2, <unk>=3), role and call markers, words, chars."""
    return list(SPECIAL_TOKENS.values()) + ROLE_TOKENS + CALL_TOKENS + WORDS + CHARS


def multiply_tokenizer(save_dir: str):
    """Build, save and return the task's PreTrainedTokenizerFast (with its chat template) in save_dir."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(multiply_vocab())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # words whole, everything else one character (digits, JSON punctuation, the space); decoding concatenates
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[A-Za-z_]+|#+|\d|\s|[^A-Za-z\d\s#]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()) + ROLE_TOKENS)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in CALL_TOKENS])
    return save_fast_tokenizer(tok, save_dir, CHAT_TEMPLATE, SPECIAL_TOKENS)
