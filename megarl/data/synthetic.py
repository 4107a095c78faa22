"""A verifiable task megarl makes itself for the tiny CPU demo: addition with a word-level tokenizer.

    prompt    [{"role": "user", "content": "What is 13 + 8 ?"}]
    response  "#### 21"                       (SFT target; the trainer appends EOS)
    ground_truth "21", data_source "arithmetic" (scored by megarl.reward's `arithmetic`)

Every number from 0 to 2*max_operand is one token, so an answer is one token and the model has to learn a lookup
of (a, b) -> a+b: a 2-layer, 128-wide model gets part of it from a few minutes of SFT, and RL has room to raise
accuracy. All text is space-separated tokens, so decode(encode(text)) == text exactly.

The chain task adds 2 to 16 distinct terms, most questions 2 or 3 and a few up to 16 (make_chain_dataset), with a
worked answer that lists the partial sums, so response lengths have a long tail (median 7 tokens, longest 91):

    prompt    [{"role": "user", "content": "What is 3 + 5 + 2 ?"}]
    response  "3 + 5 = 8 , 8 + 2 = 10 #### 10"
    ground_truth "10", data_source "arithmetic"
"""
from __future__ import annotations

import json
import os
import random
from typing import Any, Optional, Sequence

DATA_SOURCE = "arithmetic"
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
WORDS = ["What", "is", "+", "=", "?", "####", "The", "answer"]
# chain: "What is 3 + 5 + 2 ?" with 2 to CHAIN_MAX_TERMS distinct terms, P(k terms) proportional to k ** -CHAIN_TAIL
# (Zipf): about half the questions have 2 terms (a 7-token worked answer), one in 300 has 16 (91 tokens)
CHAIN_MAX_TERMS = 16
CHAIN_TAIL = 2.5
CHAIN_WORDS = [","]  # after the numbers, so the arithmetic task's token ids stay what its models were made with

# Renders "<s> <|user|> What is 13 + 8 ? </s> <|assistant|> "; EOS ends every turn, so generation stops at EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ ' <|' + message['role'] + '|> ' + message['content'] + ' ' + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ ' <|assistant|> ' }}{% endif %}"
)


def largest_number(task: str, max_operand: int) -> int:
    """The largest number the task writes: 2 * max_operand for arithmetic's a + b; for chain the sum of the
    CHAIN_MAX_TERMS largest distinct terms, max_operand + (max_operand - 1) + ... (chain, max_operand 20: 20 + 19 +
    ... + 5 = 200)."""
    if task == "chain":
        return CHAIN_MAX_TERMS * max_operand - CHAIN_MAX_TERMS * (CHAIN_MAX_TERMS - 1) // 2
    return 2 * max_operand


def arithmetic_vocab(max_operand: int, task: str = "arithmetic") -> list[str]:
    """Token strings in id order: specials (<pad>=0, <s>=1, </s>=2, <unk>=3), role markers, words, the numbers 0 to
    largest_number(task, max_operand)."""
    return (list(SPECIAL_TOKENS.values()) + ROLE_TOKENS + WORDS
            + [str(n) for n in range(largest_number(task, max_operand) + 1)] + (CHAIN_WORDS if task == "chain" else []))


def format_question(a: int, b: int) -> str:
    return f"What is {a} + {b} ?"


def format_response(a: int, b: int, answer_format: str = "gsm8k") -> str:
    """The SFT target. gsm8k: '#### 21' (scored by both the gsm8k and arithmetic rewards); short: '21';
    worked: '13 + 8 = 21 #### 21' (restates the sum first: longer, a little easier for a tiny model)."""
    total = a + b
    if answer_format == "gsm8k":
        return f"#### {total}"
    if answer_format == "short":
        return str(total)
    if answer_format == "worked":
        return f"{a} + {b} = {total} #### {total}"
    raise ValueError(f"answer_format must be gsm8k, short or worked; got {answer_format!r}")


def make_arithmetic_dataset(n: int, seed: int, max_operand: int = 20, min_operand: int = 0,
                            answer_format: str = "gsm8k", chat: bool = True, split: str = "train",
                            data_source: str = DATA_SOURCE) -> list[dict[str, Any]]:
    """n rows of "What is a + b ?" with a, b uniform in [min_operand, max_operand], reproducible from seed.

    Rows have the verl columns (prompt, data_source, ground_truth, extra_info) plus `response` for SFT.
    chat=False stores the prompt as plain text. Use different seeds for train and val files.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if not 0 <= min_operand <= max_operand:
        raise ValueError(f"need 0 <= min_operand <= max_operand, got {min_operand}, {max_operand}")
    rng = random.Random(f"megarl-arithmetic:{seed}")
    rows = []
    for i in range(n):
        a, b = rng.randint(min_operand, max_operand), rng.randint(min_operand, max_operand)
        question = format_question(a, b)
        response = format_response(a, b, answer_format)
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": question}] if chat else question,
            "response": response,
            "ground_truth": str(a + b),
            "extra_info": {"index": i, "split": split, "a": a, "b": b},
        })
    return rows


def chain_term_weights(max_terms: int = CHAIN_MAX_TERMS, tail: float = CHAIN_TAIL) -> dict[int, float]:
    """{k: probability of a k-term chain} for k in 2..max_terms, proportional to k ** -tail (a truncated Zipf law).

    chain_term_weights(4, 1.0) == {2: 6/13, 3: 4/13, 4: 3/13}; the default (16, 2.5) gives 2 terms 0.53, 3 terms 0.19,
    4 terms 0.09, 10 or more 0.04, 16 terms 0.003.
    """
    if max_terms < 2:
        raise ValueError(f"a chain has at least 2 terms; got max_terms={max_terms}")
    raw = {k: k ** -tail for k in range(2, max_terms + 1)}
    total = sum(raw.values())
    return {k: w / total for k, w in raw.items()}


def format_chain_question(terms: Sequence[int]) -> str:
    """format_chain_question([3, 5, 2]) == "What is 3 + 5 + 2 ?" (two terms: format_question's text)."""
    return "What is " + " + ".join(str(t) for t in terms) + " ?"


def format_chain_response(terms: Sequence[int], answer_format: str = "worked",
                          slips: Optional[Sequence[int]] = None) -> str:
    """The SFT target of a chain. worked: every partial sum, left to right, then the answer,
    [3, 5, 2] -> "3 + 5 = 8 , 8 + 2 = 10 #### 10" (6k - 5 tokens for k terms: 7 for 2, 91 for 16);
    gsm8k: "#### 10"; short: "10".

    slips: one offset per step added to the sum it writes, the chain going on from the written sum, as a demonstrator
    who slips would: [3, 5, 2] with slips [1, 0] -> "3 + 5 = 9 , 9 + 2 = 11 #### 11"."""
    if len(terms) < 2:
        raise ValueError(f"a chain has at least 2 terms; got {list(terms)}")
    slips = list(slips) if slips is not None else [0] * (len(terms) - 1)
    if len(slips) != len(terms) - 1:
        raise ValueError(f"{len(terms)} terms take {len(terms) - 1} slips, one a step; got {slips}")
    total = sum(terms) + sum(slips)
    if answer_format == "gsm8k":
        return f"#### {total}"
    if answer_format == "short":
        return str(total)
    if answer_format != "worked":
        raise ValueError(f"answer_format must be gsm8k, short or worked; got {answer_format!r}")
    steps, partial = [], terms[0]
    for t, slip in zip(terms[1:], slips):
        steps.append(f"{partial} + {t} = {partial + t + slip}")
        partial += t + slip
    return " , ".join(steps) + f" #### {total}"


def make_chain_dataset(n: int, seed: int, max_operand: int = 20, answer_format: str = "worked",
                       max_terms: int = CHAIN_MAX_TERMS, tail: float = CHAIN_TAIL, split: str = "train",
                       data_source: str = DATA_SOURCE, slip_share: float = 0.0) -> list[dict[str, Any]]:
    """n rows of "What is t1 + t2 + ... + tk ?", k drawn from chain_term_weights(max_terms, tail) and the k terms
    distinct, drawn from [0, max_operand], reproducible from seed: responses with a long tail of lengths (worked: median
    7 tokens, the longest 91 at 16 terms). Rows as make_arithmetic_dataset's; ground_truth is the sum, scored by the
    `arithmetic` reward; extra_info has the terms.

    Distinct, because the model finds each next term in the question by the term before it: a 2-layer model copies by
    content, not by counting positions: with repeated terms (digits 0-9) 1500 SFT steps taught it 2-term chains only
    (3 terms: 5 of 55 right), with distinct terms from [0, 17] 2000 steps got 56 of 63.

    slip_share: the share of steps whose written sum is off by 1 or 2 (a demonstrator who slips; the answer follows
    the slipped sums, ground_truth stays the true sum, extra_info counts the slips), kept within [0, the largest sum
    of max_terms distinct terms] so every number has its token."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_operand + 1 < max_terms:
        raise ValueError(f"{max_terms} distinct terms need max_operand >= {max_terms - 1}, got {max_operand}")
    if not 0 <= slip_share < 1:
        raise ValueError(f"need 0 <= slip_share < 1, got {slip_share}")
    weights = chain_term_weights(max_terms, tail)
    top = sum(range(max_operand + 1 - max_terms, max_operand + 1))
    rng = random.Random(f"megarl-chain:{seed}")
    # its own stream, so the questions of a seed stay the same whatever the share
    slip_rng = random.Random(f"megarl-chain-slips:{seed}")
    rows = []
    for i in range(n):
        k = rng.choices(list(weights), weights=list(weights.values()))[0]
        terms = rng.sample(range(max_operand + 1), k)
        slips, written = [], terms[0]
        for t in terms[1:]:
            slip = 0
            if slip_share and slip_rng.random() < slip_share:
                slip = slip_rng.choice([d for d in (-2, -1, 1, 2) if 0 <= written + t + d <= top])
            slips.append(slip)
            written += t + slip
        rows.append({
            "data_source": data_source,
            "prompt": [{"role": "user", "content": format_chain_question(terms)}],
            "response": format_chain_response(terms, answer_format, slips),
            "ground_truth": str(sum(terms)),
            "extra_info": {"index": i, "split": split, "terms": terms, "slips": sum(s != 0 for s in slips)},
        })
    return rows


def make_arithmetic_preferences(n: int, seed: int, max_operand: int = 20, answer_format: str = "gsm8k",
                                split: str = "train") -> list[dict[str, Any]]:
    """n preference pairs for reward-model training (`megarl rm`): the question, `chosen` its correct answer, and
    `rejected` a wrong one, half of them near misses (off by 1 to 3, the mistakes an SFT policy makes) and half any
    other number in [0, 2 * max_operand]. Reproducible from seed; use different seeds for train and val."""
    rng = random.Random(f"megarl-arithmetic-pairs:{seed}")
    rows = []
    top = 2 * max_operand
    for i in range(n):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        total = a + b
        if rng.random() < 0.5:
            wrong = total + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if 0 <= total + d <= top])
        else:
            wrong = rng.choice([w for w in range(top + 1) if w != total])
        # the wrong answer in the same format: a response to a question whose sum is `wrong`, with this question's terms
        rejected = format_response(a, b, answer_format).rsplit(" ", 1)[0] + f" {wrong}" if answer_format == "gsm8k" \
            else {"short": str(wrong), "worked": f"{a} + {b} = {wrong} #### {wrong}"}[answer_format]
        rows.append({
            "data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": format_question(a, b)}],
            "chosen": format_response(a, b, answer_format), "rejected": rejected,
            "ground_truth": str(total), "extra_info": {"index": i, "split": split, "a": a, "b": b, "wrong": wrong},
        })
    return rows


def write_dataset(rows: Sequence[dict[str, Any]], path: str) -> str:
    """Write rows to .parquet or .jsonl (by extension), creating the directory; returns path."""
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".parquet", ".jsonl"):
        raise ValueError(f"write_dataset: unsupported extension {ext!r} for {path!r}; use .parquet or .jsonl")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    if ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(list(rows)), tmp)
    else:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)  # readers never see a half-written file
    return path


def arithmetic_tokenizer(save_dir: str, max_operand: int = 20, task: str = "arithmetic"):
    """Build, save and return a word-level PreTrainedTokenizerFast for the arithmetic (or chain) task.

    save_dir gets tokenizer.json, tokenizer_config.json (bos/eos/pad/unk) and the chat template, so
    transformers.AutoTokenizer.from_pretrained(save_dir) and vLLM load it. Vocab size is
    largest_number(task, max_operand) + 16, plus ',' for chain (56 for arithmetic's default max_operand 20; chain
    with max_operand 20: 217); the text of larger numbers becomes <unk>.
    """

    vocab = arithmetic_vocab(max_operand, task)
    if len(vocab) >= 300:
        raise ValueError(f"{task} with max_operand={max_operand} gives a vocabulary of {len(vocab)}; keep it under "
                         f"300 (a smaller max_operand) so the tiny model stays tiny")
    return word_level_tokenizer(save_dir, vocab)


def word_level_tokenizer(save_dir: str, words: Sequence[str]):
    """The synthetic tasks' word-level tokenizer over `words` (in id order, SPECIAL_TOKENS and ROLE_TOKENS first),
    with CHAT_TEMPLATE, saved in save_dir and returned: space-separated text decodes to exactly what was encoded."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=SPECIAL_TOKENS["unk_token"]))
    # One token per number, word or symbol run; whitespace only separates. '####' stays whole; '48?' splits in two.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Split(Regex(r"\d+|[A-Za-z]+|#+|[^A-Za-z\d#]"), behavior="isolated"),
    ])
    # WordPiece's decoder joins tokens with single spaces except those starting with its continuation prefix; no token
    # here starts with "<cont>" (the default "##" would eat '####'), and cleanup=False keeps ' ?' as it is, so
    # decoding reproduces the canonical space-separated text exactly (vLLM's detokenizer uses the same decoder).
    tok.decoder = decoders.WordPiece(prefix="<cont>", cleanup=False)
    bos, eos = SPECIAL_TOKENS["bos_token"], SPECIAL_TOKENS["eos_token"]
    tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                       special_tokens=[(bos, vocab[bos])])
    tok.add_special_tokens(list(SPECIAL_TOKENS.values()) + ROLE_TOKENS)
    return save_fast_tokenizer(tok, save_dir, CHAT_TEMPLATE, SPECIAL_TOKENS)


def save_fast_tokenizer(tok, save_dir: str, chat_template: str, special_tokens: dict):
    """Wrap a `tokenizers.Tokenizer` as a PreTrainedTokenizerFast with its chat template, save it in save_dir (loadable
    by transformers 4 and 5 and vLLM) and return it."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=chat_template, model_max_length=4096,
                                   **special_tokens)
    os.makedirs(save_dir, exist_ok=True)
    fast.save_pretrained(save_dir)
    # transformers 5 writes tokenizer_class "TokenizersBackend" and keeps the template only in chat_template.jinja;
    # naming the class both major versions know and repeating the template lets 4.x loaders (older vLLM builds) read it.
    config_path = os.path.join(save_dir, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        tok_config = json.load(f)
    tok_config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template)
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(tok_config, f, indent=2)
    return fast
