"""Reading prompt files into PromptRecords, and the errors a user gets for bad input."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config.schema import DataConfig
from megarl.data import DataError, PromptRecord, load_prompts, load_prompts_from_config, write_dataset

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3 ?"}]


def _parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_parquet_verl_layout_with_nested_ground_truth(tmp_path):
    # the verl gsm8k layout: ground truth inside reward_model, extra_info a struct
    rows = [{"data_source": "openai/gsm8k", "prompt": CHAT, "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(10 + i)},
             "extra_info": {"index": i, "split": "train"}}
            for i in range(3)]
    path = _parquet(tmp_path / "train.parquet", rows)
    records = load_prompts([path])
    assert [r.index for r in records] == [0, 1, 2]
    assert records[1] == PromptRecord(index=1, uid="train.parquet#1", prompt=CHAT, data_source="openai/gsm8k",
                                      ground_truth="11", extra_info={"index": 1, "split": "train"})
    assert records[0].is_chat


def test_jsonl_top_level_ground_truth_plain_text_and_concatenation(tmp_path):
    a = _jsonl(tmp_path / "a.jsonl", [{"prompt": "1+1=", "answer": 2, "data_source": "x"}])
    b = _jsonl(tmp_path / "b.jsonl", [{"prompt": "2+2=", "answer": "4", "data_source": "x"},
                                      {"prompt": "3+3=", "answer": "6", "data_source": "x", "extra_info": {"k": 1}}])
    records = load_prompts([a, b], ground_truth_key="answer")
    assert [(r.index, r.uid, r.prompt, r.ground_truth) for r in records] == [
        (0, "a.jsonl#0", "1+1=", "2"), (1, "b.jsonl#0", "2+2=", "4"), (2, "b.jsonl#1", "3+3=", "6")]
    assert not records[0].is_chat and records[2].extra_info == {"k": 1} and records[0].extra_info == {}


def test_dotted_ground_truth_key_and_response(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "meta": {"gold": "7"}, "response": "#### 7"}])
    (rec,) = load_prompts(path, ground_truth_key="meta.gold")
    assert rec.ground_truth == "7" and rec.response == "#### 7" and rec.data_source == ""


def test_missing_prompt_column_names_file_column_columns_and_fix(tmp_path):
    path = _parquet(tmp_path / "train.parquet", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(DataError) as e:
        load_prompts([path], prompt_key="question", ground_truth_key="answer")
    msg = str(e.value)
    assert "data.prompt_key='question' not found in train.parquet" in msg
    assert "columns are ['prompt', 'answer']" in msg and "set data.prompt_key" in msg


def test_missing_ground_truth_and_data_source_columns(tmp_path):
    path = _jsonl(tmp_path / "t.jsonl", [{"prompt": "q", "answer": "1"}])
    with pytest.raises(DataError, match=r"data.ground_truth_key='ground_truth' not found in t.jsonl.*reward_model"
                                        r".ground_truth.*columns are \['prompt', 'answer'\]"):
        load_prompts(path)
    with pytest.raises(DataError, match=r"data.data_source_key='data_source' not found in t.jsonl.*reward.reward_fn"):
        load_prompts(path, ground_truth_key="answer", require_data_source=True)


def test_empty_missing_and_unsupported_files(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match=r"empty\.jsonl.* is empty \(0 rows\)"):
        load_prompts(str(empty))
    with pytest.raises(DataError, match=r"dataset file not found: '.*nope\.parquet'"):
        load_prompts(str(tmp_path / "nope.parquet"))
    csv = tmp_path / "x.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported dataset file extension '\.csv'.*\.parquet, \.jsonl"):
        load_prompts(str(csv))
    with pytest.raises(DataError, match=r"data.val_files is empty"):
        load_prompts([], setting="data.val_files")


def test_bad_rows_name_file_and_row(tmp_path):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "q", "ground_truth": "1"}\n{not json\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        load_prompts(str(bad_json))
    bad_prompt = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "ground_truth": "1"},
                                               {"prompt": [{"role": "user"}], "ground_truth": "1"}])
    with pytest.raises(DataError, match=r"p\.jsonl row 1 column 'prompt': message 0 must be a dict"):
        load_prompts(bad_prompt)
    no_gt = _jsonl(tmp_path / "g.jsonl", [{"prompt": "q", "ground_truth": None}])
    with pytest.raises(DataError, match=r"g\.jsonl row 0: ground truth is missing"):
        load_prompts(no_gt)


def test_from_config_train_and_val(tmp_path):
    rows = [{"prompt": CHAT, "data_source": "arithmetic", "ground_truth": "5"}]
    train = write_dataset(rows * 3, str(tmp_path / "train.parquet"))
    val = write_dataset(rows, str(tmp_path / "val.jsonl"))
    cfg = DataConfig(train_files=[train], val_files=[val])
    assert len(load_prompts_from_config(cfg, "train", require_data_source=True)) == 3
    assert load_prompts_from_config(cfg, "val")[0].uid == "val.jsonl#0"
    with pytest.raises(DataError, match="data.val_files is empty"):
        load_prompts_from_config(DataConfig(train_files=[train]), "val")
