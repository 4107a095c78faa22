#!/usr/bin/env python
"""Geometry3K's parquet files -> megarl image prompt files in verl's row shape (verl's data_preprocess/geo3k.py, from
local files).

    python tools/data/geo3k.py --train geometry3k/data/train-*.parquet --test geometry3k/data/test-*.parquet \\
        --out-dir data/geo3k

Download the dataset's parquet files (hiyouga/geometry3k: train, validation, test). Each input row is

    {"images": [{"bytes": b"\\x89PNG...", "path": ...}], "problem": "<image>Find x.", "answer": "3"}

and becomes one row: the problem (its `<image>` placeholder kept) with verl's thinking-then-boxed instruction appended
as a user message, the row's images as they are (encoded bytes), data_source "hiyouga/geometry3k" (scored by the
geo3k reward: 0.9 for the boxed answer, 0.1 for the format), reward_model {"ground_truth": answer}, extra_info {split,
index, answer, question}. Exit code 0, or 1 with a one-line error naming the file and row.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_rows import FORMATS, PrepError, prepare_splits  # noqa: E402

DATA_SOURCE = "hiyouga/geometry3k"
INSTRUCTION = (r"You FIRST think about the reasoning process as an internal monologue and then provide the final "
               r"answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
               r"BE put in \boxed{}.")


def read_geo3k(paths: Sequence[str]) -> list[dict[str, Any]]:
    """The {"images", "problem", "answer"} rows of the parquet files, in order. Raises PrepError naming the file and
    row for a missing file or column, or a row whose `<image>` placeholders do not match its images."""
    import pyarrow.parquet as pq

    rows = []
    for path in paths:
        if not os.path.isfile(path):
            raise PrepError(f"{path}: no such file; download Geometry3K's parquet files (hiyouga/geometry3k) and "
                            "pass their paths")
        table = pq.read_table(path)
        missing = {"images", "problem", "answer"} - set(table.column_names)
        if missing:
            raise PrepError(f"{path}: no column(s) {sorted(missing)} (has {table.column_names}); is this "
                            "Geometry3K's parquet?")
        for i, row in enumerate(table.to_pylist()):
            images = row["images"] or []
            if row["problem"].count("<image>") != len(images):
                raise PrepError(f"{path} row {i}: {row['problem'].count('<image>')} <image> placeholders for "
                                f"{len(images)} images")
            rows.append({"images": images, "problem": row["problem"], "answer": str(row["answer"])})
    if not rows:
        raise PrepError(f"{', '.join(paths)}: no rows")
    return rows


def geo3k_rows(records: Sequence[dict[str, Any]], split: str) -> list[dict[str, Any]]:
    """Image prompt rows for one split, indexed 0..N-1 in file order."""
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": f"{r['problem']} {INSTRUCTION}"}],
             "images": r["images"], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": r["answer"]},
             "extra_info": {"split": split, "index": i, "answer": r["answer"], "question": r["problem"]}}
            for i, r in enumerate(records)]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--train", nargs="+", help="Geometry3K's train parquet file(s)")
    p.add_argument("--test", nargs="+", help="Geometry3K's test parquet file(s)")
    p.add_argument("--out-dir", required=True, help="where train.<format> and test.<format> go")
    p.add_argument("--format", choices=FORMATS, default="parquet", help="output file type (default parquet)")
    p.add_argument("--max-rows", type=int, default=None, metavar="N", help="keep the first N rows of each split")
    args = p.parse_args(argv)
    if not (args.train or args.test):
        p.error("give --train and/or --test (Geometry3K's parquet files)")
    if args.max_rows is not None and args.max_rows < 1:
        p.error(f"--max-rows must be at least 1, got {args.max_rows}")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    return prepare_splits("geo3k", {"train": args.train, "test": args.test}, read_geo3k, geo3k_rows, args.out_dir,
                          args.format, args.max_rows)


if __name__ == "__main__":
    sys.exit(main())
