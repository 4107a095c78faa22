#!/usr/bin/env python
"""GSM8K's official jsonl files -> megarl prompt files (verl's examples/data_preprocess/gsm8k.py, from local files).

    python tools/data/gsm8k.py --train path/train.jsonl --test path/test.jsonl --out-dir data/gsm8k
    python tools/data/gsm8k.py --train train.jsonl --out-dir data/gsm8k --format jsonl --max-rows 256

Download train.jsonl and test.jsonl from DOWNLOAD_URL. Each input line is

    {"question": "Natalia sold clips to 48 ...", "answer": "... 48/2 = <<48/2=24>>24 clips in May. ...\\n#### 72"}

and becomes one row (tools/data/prompt_rows.py has the layout): the question with verl's instruction appended as a
user message, ground_truth "72" (the number after '####', commas removed), extra_info {split, index, question,
answer}. Writes OUT_DIR/train.<format> and OUT_DIR/test.<format> for the files given. Exit code 0, or 1 with a
one-line error naming the file and line.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_rows import FORMATS, PrepError, prepare_splits, prompt_row  # noqa: E402

DOWNLOAD_URL = "https://github.com/openai/grade-school-math/tree/master/grade_school_math/data"
# what verl's extract_solution accepts after the marker: digits, commas, a decimal point, a sign
_FINAL = re.compile(r"####\s*(-?[0-9.,]+)")


def final_answer(answer: str) -> Optional[str]:
    """'...\\n#### 1,200' -> '1200'; None without a '#### <number>'."""
    found = _FINAL.findall(answer)
    if not found:
        return None
    value = found[-1].replace(",", "").rstrip(".")
    return value if re.fullmatch(r"-?\d+(\.\d+)?", value) else None


def read_gsm8k(path: str) -> list[dict[str, str]]:
    """The {"question", "answer"} records of one official GSM8K jsonl file, with "ground_truth" added.
    Raises PrepError naming the file (and line) for a missing file, a line that is not a JSON object with string
    question and answer, or an answer without '#### <number>'."""
    if not os.path.isfile(path):
        raise PrepError(f"{path}: no such file; download GSM8K's train.jsonl and test.jsonl from {DOWNLOAD_URL} "
                        f"and pass their paths with --train / --test")
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepError(f"{where}: not JSON ({e.msg}); each line of a GSM8K file is one JSON object "
                                f"with 'question' and 'answer'") from None
            if not (isinstance(row, dict) and isinstance(row.get("question"), str)
                    and isinstance(row.get("answer"), str)):
                got = sorted(row) if isinstance(row, dict) else type(row).__name__
                raise PrepError(f"{where}: expected an object with string 'question' and 'answer', got {got}; "
                                f"is this GSM8K's official jsonl ({DOWNLOAD_URL})?")
            truth = final_answer(row["answer"])
            if truth is None:
                raise PrepError(f"{where}: the answer has no '#### <number>' final answer (ends with "
                                f"{row['answer'][-40:]!r}); fix or remove the line")
            records.append({"question": row["question"], "answer": row["answer"], "ground_truth": truth})
    if not records:
        raise PrepError(f"{path}: the file has no rows; download it again from {DOWNLOAD_URL}")
    return records


def gsm8k_rows(records: Sequence[dict[str, str]], split: str) -> list[dict[str, Any]]:
    """Prompt rows (prompt_rows.prompt_row) for one split, indexed 0..N-1 in file order."""
    return [prompt_row(r["question"], r["ground_truth"], split, i, r["answer"]) for i, r in enumerate(records)]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", help="GSM8K's train.jsonl")
    p.add_argument("--test", help="GSM8K's test.jsonl")
    p.add_argument("--out-dir", required=True, help="where train.<format> and test.<format> go")
    p.add_argument("--format", choices=FORMATS, default="parquet", help="output file type (default parquet)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N", help="keep the first N rows of each file")
    args = p.parse_args(argv)
    if not (args.train or args.test):
        p.error(f"give --train and/or --test (GSM8K's jsonl files, from {DOWNLOAD_URL})")
    if args.max_rows is not None and args.max_rows < 1:
        p.error(f"--max-rows must be at least 1, got {args.max_rows}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return prepare_splits("gsm8k", {"train": args.train, "test": args.test}, read_gsm8k, gsm8k_rows, args.out_dir,
                          args.format, args.max_rows)


if __name__ == "__main__":
    sys.exit(main())
