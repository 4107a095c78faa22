"""tools/data/: GSM8K's official jsonl -> megarl prompt files, and the offline word-problem generator. Both write rows
that megarl's own loader reads and megarl's gsm8k rule scores; the generator's answers are recomputed here from the
operations each row records, and its held-out templates never reach train."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from megarl.data import load_prompts
from megarl.reward import rules
from megarl.reward.registry import RewardRouter

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "tools" / "data"
# verl's examples/data_preprocess/gsm8k.py, word for word: the spec, not read from the code under test
VERL_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def _load(name):
    # tools/ is not a package; a private module name keeps these off any other test's `import gsm8k`
    spec = importlib.util.spec_from_file_location(f"_megarl_tools_data_{name}", TOOLS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


gsm8k_tool = _load("gsm8k")
word_problems = _load("word_problems")

# GSM8K's official format (github.com/openai/grade-school-math): calculator annotations <<...>>, final line '#### N'
GSM8K_LINES = [
    {"question": "Maya reads 12 pages of her book on Monday and twice as many pages on Tuesday. How many pages did "
                 "she read on the two days?",
     "answer": "On Tuesday Maya read 12*2 = <<12*2=24>>24 pages.\nAltogether she read 12+24 = <<12+24=36>>36 "
               "pages.\n#### 36"},
    {"question": "A bakery sells 300 rolls every morning and 100 rolls every afternoon. How many rolls does it sell "
                 "in 3 days?",
     "answer": "Each day it sells 300+100 = <<300+100=400>>400 rolls.\nIn 3 days it sells 400*3 = <<400*3=1200>>1200 "
               "rolls.\n#### 1,200"},
    {"question": "Carlos buys 4 notebooks for $3 each and a pen for $2. He pays with a $20 bill. How much change does "
                 "he get?",
     "answer": "The notebooks cost 4*3 = $<<4*3=12>>12.\nHe spends 12+2 = $<<12+2=14>>14.\nHis change is 20-14 = "
               "$<<20-14=6>>6.\n#### 6"},
    {"question": "A class of 28 students splits into teams of 4. How many teams are there?",
     "answer": "There are 28/4 = <<28/4=7>>7 teams.\n#### 7"},
]
GSM8K_TRUTHS = ["36", "1200", "6", "7"]  # the numbers after '####' above, commas removed, by hand


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def _score(record, answer):
    """What the trainer gives `response` when reward.reward_fn is None: the rule that data_source names."""
    return RewardRouter()(record.data_source, response(answer), record.ground_truth, record.extra_info)


def response(answer):
    return f"Let me work it out step by step.\nSo the final answer is:\n#### {answer}"


# ----------------------------------------------------------------------------------------------------------------------
# gsm8k.py


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_gsm8k_rows_load_with_megarl_and_score(tmp_path, capsys, fmt):
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    test = _write_jsonl(tmp_path / "test.jsonl", GSM8K_LINES[:2])
    out = tmp_path / "out"
    assert gsm8k_tool.main(["--train", train, "--test", test, "--out-dir", str(out), "--format", fmt]) == 0
    printed = capsys.readouterr().out
    assert f"4 train rows -> {out / f'train.{fmt}'}" in printed and f"2 test rows -> {out / f'test.{fmt}'}" in printed

    records = load_prompts(str(out / f"train.{fmt}"))
    assert [r.ground_truth for r in records] == GSM8K_TRUTHS
    for record, line, truth in zip(records, GSM8K_LINES, GSM8K_TRUTHS):
        assert record.prompt == [{"role": "user", "content": line["question"] + " " + VERL_INSTRUCTION}]
        assert record.data_source == "openai/gsm8k"
        assert record.extra_info["split"] == "train" and record.extra_info["question"] == line["question"]
        assert record.extra_info["answer"] == line["answer"]
        assert rules.gsm8k("openai/gsm8k", response(truth), record.ground_truth) == 1.0
        assert _score(record, truth) == 1.0
        assert _score(record, int(truth) + 1) == 0.0
        # the official solution itself is a correct response
        assert rules.gsm8k("openai/gsm8k", line["answer"], record.ground_truth) == 1.0
    assert [r.extra_info["index"] for r in records] == [0, 1, 2, 3]
    assert [r.extra_info["split"] for r in load_prompts(str(out / f"test.{fmt}"))] == ["test", "test"]


def test_gsm8k_keeps_verls_reward_model_column(tmp_path):
    rows = gsm8k_tool.gsm8k_rows(gsm8k_tool.read_gsm8k(_write_jsonl(tmp_path / "t.jsonl", GSM8K_LINES)), "train")
    assert [r["reward_model"] for r in rows] == [{"style": "rule", "ground_truth": t} for t in GSM8K_TRUTHS]
    # a loader that only knows verl's nested column finds the same answers
    for row in rows:
        del row["ground_truth"]
    path = tmp_path / "nested.jsonl"
    _write_jsonl(path, rows)
    assert [r.ground_truth for r in load_prompts(str(path))] == GSM8K_TRUTHS


def test_gsm8k_max_rows_and_train_only(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    out = tmp_path / "out"
    assert gsm8k_tool.main(["--train", train, "--out-dir", str(out), "--max-rows", "2", "--format", "jsonl"]) == 0
    assert [r.ground_truth for r in load_prompts(str(out / "train.jsonl"))] == GSM8K_TRUTHS[:2]
    assert not (out / "test.jsonl").exists()


def _error(capsys, argv):
    assert gsm8k_tool.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_gsm8k_errors_name_the_file_and_line(tmp_path, capsys):
    out = ["--out-dir", str(tmp_path / "out")]
    missing = str(tmp_path / "nowhere" / "train.jsonl")
    err = _error(capsys, ["--train", missing] + out)
    assert missing in err and "github.com/openai/grade-school-math" in err

    good = json.dumps(GSM8K_LINES[0])
    not_json = tmp_path / "broken.jsonl"
    not_json.write_text(good + "\n" + '{"question": "How many?", "answer": "#### 3"\n')
    assert f"{not_json}:2: not JSON" in _error(capsys, ["--train", str(not_json)] + out)

    no_marker = tmp_path / "no_marker.jsonl"
    no_marker.write_text(good + "\n\n" + json.dumps({"question": "How many?", "answer": "It is 3."}) + "\n")
    err = _error(capsys, ["--test", str(no_marker)] + out)
    assert f"{no_marker}:3:" in err and "####" in err

    # a bad test file stops the run before the good train file is written
    assert not (tmp_path / "out").exists()


def test_gsm8k_script_runs_from_any_directory(tmp_path):
    train = _write_jsonl(tmp_path / "train.jsonl", GSM8K_LINES)
    r = subprocess.run([sys.executable, str(TOOLS / "gsm8k.py"), "--train", train, "--out-dir", "out"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert [rec.ground_truth for rec in load_prompts(str(tmp_path / "out" / "train.parquet"))] == GSM8K_TRUTHS


# ----------------------------------------------------------------------------------------------------------------------
# word_problems.py


def recompute(start, operations):
    """The answer from the recorded operations, independently of the generator; every value a non-negative int."""
    x = start
    for op in operations:
        n = op["value"]
        if op["op"] == "add":
            x += n
        elif op["op"] == "sub":
            x -= n
        elif op["op"] == "mul":
            x *= n
        elif op["op"] == "div":
            assert x % n == 0, f"{x} / {n} is not exact"
            x //= n
        else:
            raise AssertionError(f"unknown operation {op}")
        assert x >= 0
    return x


def test_word_problems_are_deterministic_per_seed():
    rows = word_problems.make_split(60, 5, "train", [1, 2, 3], 20)
    assert rows == word_problems.make_split(60, 5, "train", [1, 2, 3], 20)
    assert rows != word_problems.make_split(60, 6, "train", [1, 2, 3], 20)
    assert len({r["extra_info"]["question"] for r in rows}) == 60


@pytest.mark.parametrize("split", ["train", "val_unseen"])
def test_word_problem_answers_follow_from_their_operations(split):
    max_number = 15
    rows = word_problems.make_split(300, 1, split, [1, 2, 3], max_number)
    assert {r["extra_info"]["steps"] for r in rows} == {1, 2, 3}
    kinds = set()
    for row in rows:
        info = row["extra_info"]
        ops = info["operations"]
        assert len(ops) == info["steps"] == len(info["template_ids"]) - 1  # a start sentence, then one per operation
        assert row["ground_truth"] == str(recompute(info["start"], ops)) == row["reward_model"]["ground_truth"]
        assert 1 <= info["start"] <= max_number
        for op in ops:
            kinds.add(op["op"])
            top = min(12, max_number) if op["op"] in ("mul", "div") else max_number
            assert 1 <= op["value"] <= top
            # the question states every operand
            assert re.search(rf"\b{op['value']}\b", info["question"]), (op, info["question"])
        assert re.match(rf"\D*\b{info['start']}\b", info["question"]), info["question"]
        assert info["question"].endswith("?") and row["prompt"][0]["content"].endswith(" " + VERL_INSTRUCTION)
        # the worked solution recorded beside the question is itself a correct response
        assert rules.gsm8k("openai/gsm8k", info["answer"], row["ground_truth"], strict=True) == 1.0
    assert kinds == {"add", "sub", "mul", "div"}


def test_unseen_templates_never_reach_train_or_val():
    ids = {split: {t for r in word_problems.make_split(400, 2, split, [1, 2, 3], 20)
                   for t in r["extra_info"]["template_ids"]} for split in ("train", "val", "val_unseen")}
    assert ids["train"].isdisjoint(ids["val_unseen"]) and ids["val"].isdisjoint(ids["val_unseen"])
    assert ids["val"] <= ids["train"]
    # the held-out side has sentences of every kind, and at least 6 templates of each operation exist
    kind = {t.id: t.kind for t in word_problems.TEMPLATES}
    assert {kind[t] for t in ids["val_unseen"]} == {"start", "add", "sub", "mul", "div"}
    for k in ("add", "sub", "mul", "div"):
        assert sum(1 for t in word_problems.TEMPLATES if t.kind == k) >= 6


def test_val_avoids_the_questions_it_is_given():
    plain = word_problems.make_split(40, 0, "val", [1], 20)
    questions = {r["extra_info"]["question"] for r in plain}
    avoiding = word_problems.make_split(40, 0, "val", [1], 20, avoid=questions)
    assert questions.isdisjoint(r["extra_info"]["question"] for r in avoiding)


def test_word_problem_bad_arguments_say_what_to_change():
    with pytest.raises(word_problems.PrepError, match="steps must be"):
        word_problems.make_split(5, 0, "train", [4], 20)
    with pytest.raises(word_problems.PrepError, match="unknown split 'test'"):
        word_problems.make_split(5, 0, "test", [1], 20)
    with pytest.raises(word_problems.PrepError, match="max_number must be at least 2"):
        word_problems.make_split(5, 0, "train", [1], 1)


def test_word_problem_files_load_with_megarl_and_score(tmp_path, capsys):
    out = tmp_path / "wp"
    argv = ["--num-train", "300", "--num-val", "40", "--steps", "1", "2", "--max-number", "20", "--seed", "0"]
    assert word_problems.main(["--out-dir", str(out)] + argv) == 0
    printed = capsys.readouterr().out
    assert "300 train rows" in printed and "40 val_unseen rows" in printed and "with 2 steps" in printed

    records = {split: load_prompts(str(out / f"{split}.parquet")) for split in ("train", "val", "val_unseen")}
    assert [len(records[s]) for s in records] == [300, 40, 40]
    questions = {s: {r.extra_info["question"] for r in recs} for s, recs in records.items()}
    assert questions["train"].isdisjoint(questions["val"])
    for split, recs in records.items():
        for record in recs:
            assert record.extra_info["split"] == split and record.extra_info["steps"] in (1, 2)
            assert record.data_source == "openai/gsm8k" and isinstance(record.ground_truth, str)
            assert rules.gsm8k("openai/gsm8k", response(record.ground_truth), record.ground_truth) == 1.0
            assert _score(record, record.ground_truth) == 1.0
            assert _score(record, int(record.ground_truth) + 1) == 0.0

    # the same seed gives the same files, in either format
    assert word_problems.main(["--out-dir", str(tmp_path / "again"), "--format", "jsonl"] + argv) == 0
    again = load_prompts(str(tmp_path / "again" / "val_unseen.jsonl"))
    assert [(r.prompt, r.ground_truth) for r in again] == [(r.prompt, r.ground_truth) for r in records["val_unseen"]]


def test_word_problems_script_runs_from_any_directory(tmp_path):
    r = subprocess.run([sys.executable, str(TOOLS / "word_problems.py"), "--out-dir", "wp", "--num-train", "20",
                        "--num-val", "5", "--steps", "3", "--format", "jsonl"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "20 train rows (20 with 3 steps)" in r.stdout
    assert {rec.extra_info["steps"] for rec in load_prompts(str(tmp_path / "wp" / "train.jsonl"))} == {3}


def test_validate_names_the_data_command_demo_real_runs():
    """The command validate prints for missing word-problem files is the one `make demo-real` runs."""
    from megarl.config.sources import WORD_PROBLEMS_COMMAND

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    args = re.search(r"^WORD_PROBLEMS \?= (.*)$", makefile, re.M).group(1).strip()
    assert WORD_PROBLEMS_COMMAND == f"python tools/data/word_problems.py --out-dir data/word_problems {args}"


# ----------------------------------------------------------------------------------------------------------------------
# geo3k.py

geo3k_tool = _load("geo3k")
# verl's examples/data_preprocess/geo3k.py instruction, word for word: the spec, not read from the code under test
VERL_GEO3K_INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the "
                          r"final answer. The reasoning process MUST BE enclosed within <think> </think> tags. The "
                          r"final answer MUST BE put in \boxed{}.")


def _geo3k_parquet(path, problems):
    """Geometry3K's published layout: images as {bytes, path} structs, the problem with its <image>, the answer."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rows = []
    for i, (problem, answer) in enumerate(problems):
        buf = io.BytesIO()
        Image.new("RGB", (40 + i, 30), (10 * i, 0, 0)).save(buf, format="PNG")
        rows.append({"images": [{"bytes": buf.getvalue(), "path": None}], "problem": problem, "answer": answer})
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_geo3k_rows_load_with_megarl_decode_and_score(tmp_path):
    from megarl.data.images import decode_problem

    train = _geo3k_parquet(tmp_path / "train.parquet", [("<image>Find x.", "3"), ("<image>Find the area.", "24")])
    out = tmp_path / "geo3k"
    assert geo3k_tool.main(["--train", train, "--out-dir", str(out)]) == 0
    records = load_prompts([str(out / "train.parquet")], require_data_source=True)
    assert [r.ground_truth for r in records] == ["3", "24"]
    assert records[0].prompt[0]["content"] == "<image>Find x. " + VERL_GEO3K_INSTRUCTION
    assert all(len(r.images) == 1 and decode_problem(r.images[0]) is None for r in records)
    RewardRouter().check(r.data_source for r in records)
    assert rules.geo3k(records[0].data_source, r"<think>ok</think> \boxed{3}", records[0].ground_truth)["score"] == 1


def test_geo3k_refuses_a_row_whose_placeholders_do_not_match(tmp_path, capsys):
    bad = _geo3k_parquet(tmp_path / "bad.parquet", [("Find x, no placeholder.", "3")])
    assert geo3k_tool.main(["--train", bad, "--out-dir", str(tmp_path / "out")]) == 1
    assert "row 0" in capsys.readouterr().err and not (tmp_path / "out").exists()
