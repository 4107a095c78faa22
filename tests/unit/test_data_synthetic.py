"""The arithmetic task and its word-level tokenizer; prompt encoding and the prompt_length policy."""
import pytest

from megarl.data import (DataError, PromptRecord, arithmetic_tokenizer, encode_prompts, format_report, load_prompts,
                         make_arithmetic_dataset, write_dataset)
from megarl.data.synthetic import arithmetic_vocab
from megarl.reward import compute_rewards, RewardInput, RewardRouter


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("arith_tok")
    arithmetic_tokenizer(str(path), max_operand=20)
    return str(path)


@pytest.fixture(scope="module")
def tokenizer(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)  # what the trainer and vLLM do


def test_dataset_rows_are_reproducible_and_correct():
    rows = make_arithmetic_dataset(50, seed=3, max_operand=20)
    assert rows == make_arithmetic_dataset(50, seed=3, max_operand=20)
    assert rows != make_arithmetic_dataset(50, seed=4, max_operand=20)
    for row in rows:
        a, b = row["extra_info"]["a"], row["extra_info"]["b"]
        assert 0 <= a <= 20 and 0 <= b <= 20
        assert row["prompt"] == [{"role": "user", "content": f"What is {a} + {b} ?"}]
        assert row["ground_truth"] == str(a + b) and row["response"] == f"#### {a + b}"
        assert row["data_source"] == "arithmetic"
    worked = make_arithmetic_dataset(1, seed=0, answer_format="worked", chat=False)[0]
    a, b = worked["extra_info"]["a"], worked["extra_info"]["b"]
    assert worked["response"] == f"{a} + {b} = {a + b} #### {a + b}" and isinstance(worked["prompt"], str)


@pytest.mark.parametrize("ext", ["parquet", "jsonl"])
def test_write_and_load_round_trip_scores_one_with_the_router(tmp_path, ext):
    rows = make_arithmetic_dataset(6, seed=1)
    records = load_prompts(write_dataset(rows, str(tmp_path / f"train.{ext}")), require_data_source=True)
    assert [r.prompt for r in records] == [r["prompt"] for r in rows]
    assert [r.response for r in records] == [r["response"] for r in rows]
    # the SFT target is exactly what the reward accepts
    samples = [RewardInput(r.data_source, r.response, r.ground_truth, r.extra_info) for r in records]
    scores, metrics, _ = compute_rewards(RewardRouter(), samples, num_workers=0)
    assert scores == [1.0] * 6 and metrics["acc"] == [1.0] * 6


def test_tokenizer_vocab_round_trip_and_special_tokens(tokenizer):
    assert len(tokenizer) == len(arithmetic_vocab(20)) == 56 < 300
    assert (tokenizer.pad_token, tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == (
        "<pad>", "<s>", "</s>", "<unk>")
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (0, 1, 2)
    for text in ["What is 13 + 8 ?", "#### 21", "13 + 8 = 21 #### 21", "0"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.unk_token_id not in ids
        assert tokenizer.decode(ids) == text
    ids = tokenizer("What is 40 + 0 ?")["input_ids"]  # plain encode adds BOS; one token per number
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "What", "is", "40", "+", "0", "?"]
    assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == "What is 40 + 0 ?"
    assert tokenizer("41", add_special_tokens=False)["input_ids"] == [tokenizer.unk_token_id]  # over 2*max_operand


def test_chat_template_renders_messages_and_generation_prompt(tokenizer):
    messages = [{"role": "user", "content": "What is 13 + 8 ?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s> <|user|> What is 13 + 8 ? </s> <|assistant|> "
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert without == "<s> <|user|> What is 13 + 8 ? </s>"
    record = PromptRecord(index=0, uid="t#0", prompt=messages)
    _, (ids,), _ = encode_prompts([record], tokenizer, prompt_length=32)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "<|user|>", "What", "is", "13", "+", "8", "?", "</s>",
                                                    "<|assistant|>"]


def test_a_mixed_batch_encodes_like_each_prompt_alone(tokenizer):
    from megarl.data.encode import encode_many

    records = [PromptRecord(index=i, uid=f"m#{i}", prompt=[{"role": "user", "content": f"What is {i} + 2 ?"}]
                            if i % 3 else f"What is {i} + {i} ?") for i in range(7)]
    expected = [tokenizer(r.prompt)["input_ids"] if isinstance(r.prompt, str) else
                tokenizer.apply_chat_template(r.prompt, add_generation_prompt=True, tokenize=False) for r in records]
    expected = [e if isinstance(e, list) else tokenizer(e, add_special_tokens=False)["input_ids"] for e in expected]
    assert encode_many(records, tokenizer) == expected
    assert tokenizer.convert_ids_to_tokens(expected[1])[-1] == "<|assistant|>"  # chat rows really are chats


def _records(n_short, n_long):
    short = [PromptRecord(index=i, uid=f"f#{i}", prompt="What is 1 + 2 ?") for i in range(n_short)]  # 7 tokens w/ BOS
    long = [PromptRecord(index=n_short + i, uid=f"f#{n_short + i}", prompt="What is 1 + 2 ? " * 3)  # 19 tokens
            for i in range(n_long)]
    return short + long


def test_prompt_length_policies_report_counts(tokenizer):
    records = _records(3, 2)
    kept, ids, report = encode_prompts(records, tokenizer, prompt_length=10, truncation="filter")
    assert [r.uid for r in kept] == ["f#0", "f#1", "f#2"] and all(len(i) == 7 for i in ids)
    assert report == {"num_prompts": 5, "num_filtered": 2, "num_truncated": 0, "num_kept": 3, "max_prompt_tokens": 19}
    assert "2 over prompt_length filtered" in format_report(report)
    assert kept[0].prompt_ids == tuple(ids[0])

    kept, ids, report = encode_prompts(records, tokenizer, prompt_length=10, truncation="left")
    assert report["num_truncated"] == 2 and report["num_filtered"] == 0 and len(kept) == 5
    full = tokenizer(records[3].prompt)["input_ids"]
    assert ids[3] == full[-10:]
    _, ids, _ = encode_prompts(records, tokenizer, prompt_length=10, truncation="right")
    assert ids[3] == full[:10] and ids[0] == tokenizer(records[0].prompt)["input_ids"]


def test_prompt_too_long_error_names_sample_and_length(tokenizer):
    with pytest.raises(DataError, match=r"prompt f#3 \(index 3\) has 19 tokens, over rollout.prompt_length=10 "
                                        r"\(2 of 5 prompts are over\).*data.truncation"):
        encode_prompts(_records(3, 2), tokenizer, prompt_length=10, truncation="error")
    with pytest.raises(DataError, match="all 2 prompts are longer"):
        encode_prompts(_records(0, 2), tokenizer, prompt_length=10, truncation="filter")


def test_chat_prompt_without_template_is_an_error(tokenizer):
    record = PromptRecord(index=0, uid="t#4", prompt=[{"role": "user", "content": "What is 1 + 2 ?"}])
    with pytest.raises(DataError, match=r"t#4 is a list of chat messages but data.apply_chat_template=false"):
        encode_prompts([record], tokenizer, prompt_length=32, apply_chat_template=False)
