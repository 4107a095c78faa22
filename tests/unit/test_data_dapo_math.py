"""tools/data/dapo_math.py on hand-written rows in DAPO-Math-17k's official layout (BytedTsinghua-SIA/DAPO-Math-17k:
data_source, prompt as chat messages, ability, reward_model {ground_truth, style}, extra_info {index}), each prompt
repeated as the official file repeats them: the repeats go, the order stays, megarl's loader reads the output and
`megarl validate` accepts it in the DAPO recipe."""
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megarl.config import ConfigError
from megarl.data import load_prompts
from megarl.validate import load_config
from tests.helpers.dapo_rows import FOOT, HEAD, SCRIPT, load_script, official_row

ROOT = Path(__file__).resolve().parents[2]
dapo_math = load_script()


# (problem, answer) and how many times each appears; the official file interleaves the copies
PROBLEMS = [("What is 3 + 5 ?", "8"), ("What is 7 + 9 ?", "16"), ("What is 12 + 4 ?", "16"),
            ("What is 6 + 6 ?", "12"), ("What is 1 + 19 ?", "20")]
ORDER = [0, 1, 0, 2, 3, 1, 0, 4, 2, 3, 3, 0]  # 12 rows: copies 4, 2, 2, 3, 1


def write_official(path: Path, order=ORDER, problems=PROBLEMS) -> Path:
    rows = [official_row(*problems[i], f"uuid-{i}") for i in order]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _run(capsys, *args):
    """main() in this process (a subprocess per case costs seconds on a loaded machine; one test runs the CLI)."""
    capsys.readouterr()
    code = dapo_math.main([str(a) for a in args])
    out = capsys.readouterr()
    return Result(code, out.out, out.err)


def test_the_command_line(tmp_path):
    src = write_official(tmp_path / "dapo-math-17k.parquet")
    out = subprocess.run([sys.executable, str(SCRIPT), "--input", str(src), "--out-dir", str(tmp_path / "out")],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "dapo_math: 5 train rows -> " in out.stdout
    bad = subprocess.run([sys.executable, str(SCRIPT), "--input", str(tmp_path / "missing.parquet"), "--out-dir",
                          str(tmp_path / "out2")], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and "no such file" in bad.stderr


def test_repeats_dropped_order_kept_layout_unchanged(capsys, tmp_path):
    src = write_official(tmp_path / "dapo-math-17k.parquet")
    out = _run(capsys, "--input", src, "--out-dir", tmp_path / "out")
    assert out.returncode == 0, out.stderr
    assert "12 rows, 5 distinct prompts (7 repeated rows dropped)" in out.stdout
    assert "read 12 of 12 rows, 5 distinct prompts" in out.stderr  # progress
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["prompt"][0]["content"] for r in rows] == [HEAD + p + FOOT for p, _ in PROBLEMS]  # first-seen order
    assert rows[0] == {"data_source": "math_dapo",
                       "prompt": [{"role": "user", "content": HEAD + PROBLEMS[0][0] + FOOT}],
                       "ability": "MATH", "reward_model": {"ground_truth": "8", "style": "rule-lighteval/MATH_v2"},
                       "extra_info": {"index": "uuid-0", "split": "train"}}
    records = load_prompts([str(tmp_path / "out" / "train.parquet")])  # megarl's own loader
    assert [r.ground_truth for r in records] == [a for _, a in PROBLEMS]
    assert {r.data_source for r in records} == {"math_dapo"} and all(r.is_chat for r in records)


def test_val_size_holds_out_distinct_prompts(capsys, tmp_path):
    src = write_official(tmp_path / "in.parquet")
    out = _run(capsys, "--input", src, "--out-dir", tmp_path / "out", "--val-size", 2, "--seed", 3,
               "--format", "jsonl")
    assert out.returncode == 0, out.stderr
    train = load_prompts([str(tmp_path / "out" / "train.jsonl")])
    val = load_prompts([str(tmp_path / "out" / "val.jsonl")])
    assert len(train) == 3 and len(val) == 2
    texts = [r.prompt[0]["content"] for r in train + val]
    assert sorted(texts) == sorted(HEAD + p + FOOT for p, _ in PROBLEMS)  # disjoint, nothing lost
    assert {r.extra_info["split"] for r in val} == {"val"}
    # each file keeps file order
    position = {HEAD + p + FOOT: i for i, (p, _) in enumerate(PROBLEMS)}
    for part in (train, val):
        assert [position[r.prompt[0]["content"]] for r in part] == sorted(position[r.prompt[0]["content"]]
                                                                           for r in part)


def test_conflicting_repeat_is_reported_and_the_first_kept(capsys, tmp_path):
    rows = [official_row("What is 2 + 2 ?", "4", "a"), official_row("What is 2 + 2 ?", "5", "b")]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    out = _run(capsys, "--input", tmp_path / "in.parquet", "--out-dir", tmp_path / "out")
    assert out.returncode == 0, out.stderr
    assert "1 repeated rows had another ground truth" in out.stderr
    kept = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in kept] == ["4"]


@pytest.mark.parametrize("make, expected", [
    (lambda p: None, ["no such file", "--input"]),
    (lambda p: pq.write_table(pa.Table.from_pylist([{"data_source": "math_dapo", "prompt": "x",
                                                     "answer": "3"}]), p),
     ["no column 'reward_model'", '"ground_truth"', "columns are ['data_source', 'prompt', 'answer']"]),
    (lambda p: pq.write_table(pa.Table.from_pylist([{**official_row("q", "1", "u"), "prompt": "plain text"}]), p),
     ["row 0", "column 'prompt' must be a list of chat messages", "'plain text'"]),
    (lambda p: pq.write_table(pa.Table.from_pylist([official_row("q", "1", "u"),
                                                    {**official_row("r", "1", "u"),
                                                     "reward_model": {"ground_truth": "", "style": "rule"}}]), p),
     ["row 1", "column 'reward_model'", "non-empty ground_truth"]),
    (lambda p: p.write_text("not parquet"), ["not a readable parquet file"]),
])
def test_errors_name_the_column_and_what_is_expected(capsys, tmp_path, make, expected):
    path = tmp_path / "in.parquet"
    make(path)
    out = _run(capsys, "--input", path, "--out-dir", tmp_path / "out")
    assert out.returncode == 1
    assert out.stderr.startswith("dapo_math.py: error: ") and "Traceback" not in out.stderr, out.stderr
    for part in expected:
        assert part in out.stderr, (part, out.stderr)
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_val_size_must_leave_rows(capsys, tmp_path):
    out = _run(capsys, "--input", write_official(tmp_path / "in.parquet"), "--out-dir", tmp_path / "out",
               "--val-size", 5)
    assert out.returncode == 1 and "--val-size 5 leaves no train rows: the file has 5 distinct prompts" in out.stderr


def test_megarl_validate_accepts_the_output_in_the_dapo_recipe(tmp_path):
    src = write_official(tmp_path / "in.parquet")
    assert dapo_math.main(["--input", str(src), "--out-dir", str(tmp_path / "out"), "--val-size", "2"]) == 0
    files = [f"data.train_files=[{tmp_path / 'out' / 'train.parquet'}]",
             f"data.val_files=[{tmp_path / 'out' / 'val.parquet'}]"]
    cfg = load_config(ROOT / "recipes" / "dapo_tiny_cpu.yaml", files)
    assert cfg.reward.reward_fn is None  # rows are routed by data_source: math_dapo must be a registered rule
    # the same rows with a data_source no rule handles are refused: validate reads the files' data_source column
    rows = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([{**r, "data_source": "no_such_source"} for r in rows]),
                   tmp_path / "out" / "train.parquet")
    with pytest.raises(ConfigError, match="no_such_source"):
        load_config(ROOT / "recipes" / "dapo_tiny_cpu.yaml", files)
