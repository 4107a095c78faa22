#!/usr/bin/env python
"""DAPO-Math-17k's official parquet file (or AIME-2024's, in the same layout) -> megarl prompt files.

    python tools/data/dapo_math.py --input DIR/data/dapo-math-17k.parquet --out-dir data/dapo-math-17k
    python tools/data/dapo_math.py --input DIR2/data/aime-2024.parquet --out-dir data/aime-2024 --split test

Download the files from the datasets BytedTsinghua-SIA/DAPO-Math-17k and BytedTsinghua-SIA/AIME-2024. Each official
row is

    data_source   "math_dapo"             megarl's registered math_dapo rule scores it (verl's "Answer:" rule)
    prompt        [{"role": "user", "content": instruction + problem + reminder}]
    ability       "MATH"
    reward_model  {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"}
    extra_info    {"index": "<uuid>"}

and is kept in that layout (verl reads the output too), with extra_info.split added. The official training file holds
each prompt many times (about 100 copies); the first row of each distinct prompt is kept, in file order, and the count
of repeated rows dropped is printed: sample a prompt several times with rollout.n instead. Writes
OUT_DIR/<split>.<format> (and OUT_DIR/val.<format> with --val-size). Exit code 0, or 1 with a one-line error naming
the file, the row or column and what was expected; nothing is written on an error.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prompt_rows import FORMATS, PrepError, write_split  # noqa: E402

DATASETS = "BytedTsinghua-SIA/DAPO-Math-17k (training) or BytedTsinghua-SIA/AIME-2024 (validation)"
COLUMNS = {"data_source": "a string such as \"math_dapo\"",
           "prompt": "a list of chat messages [{\"role\": ..., \"content\": ...}]",
           "reward_model": "a struct {\"ground_truth\": ..., \"style\": ...}"}
BATCH_ROWS = 65536  # rows read at a time: the training file has 1.8M rows


def read_batches(path: str) -> Iterator[tuple[list[dict[str, Any]], int]]:
    """The rows of an official .parquet (or .jsonl) file in batches, each with the file's total row count."""
    if not os.path.isfile(path):
        raise PrepError(f"{path}: no such file; download it from {DATASETS} and pass its path with --input")
    if path.endswith(".jsonl"):
        with open(path, encoding="utf-8") as f:
            rows = []
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise PrepError(f"{path}:{lineno}: not JSON ({e.msg})") from None
        yield rows, len(rows)
        return
    import pyarrow.parquet as pq

    try:
        handle = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for a file that is not parquet
        raise PrepError(f"{path}: not a readable parquet file ({type(e).__name__}: {e}); pass the official "
                        f"dapo-math-17k.parquet (or a .jsonl of the same rows)") from None
    names = handle.schema_arrow.names
    for column, expected in COLUMNS.items():
        if column not in names:
            raise PrepError(f"{path}: no column '{column}' (expected {expected}); its columns are {names}: is this "
                            f"a file of {DATASETS}?")
    total = handle.metadata.num_rows
    for batch in handle.iter_batches(batch_size=BATCH_ROWS):
        yield batch.to_pylist(), total


def checked(row: dict, i: int, path: str) -> tuple[str, str]:
    """(the prompt's text, the ground truth) of official row i, or PrepError naming the row and column."""
    where = f"{path}: row {i}"
    for column, expected in COLUMNS.items():
        if column not in row:
            raise PrepError(f"{where}: no column '{column}' (expected {expected})")
    if not isinstance(row["data_source"], str) or not row["data_source"]:
        raise PrepError(f"{where}: column 'data_source' must be a non-empty string, got {row['data_source']!r}")
    prompt = row["prompt"]
    if not isinstance(prompt, list) or not prompt or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) and isinstance(m.get("role"), str)
            for m in prompt):
        raise PrepError(f"{where}: column 'prompt' must be a list of chat messages {{\"role\": ..., \"content\": "
                        f"...}}, got {str(repr(prompt))[:120]}")
    reward = row["reward_model"]
    truth = reward.get("ground_truth") if isinstance(reward, dict) else None
    if truth is None or str(truth).strip() == "":
        raise PrepError(f"{where}: column 'reward_model' must be a struct with a non-empty ground_truth, got "
                        f"{str(repr(reward))[:120]}")
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt), str(truth)


def distinct_rows(path: str, max_rows: Optional[int] = None) -> tuple[list[dict], dict]:
    """The first row of each distinct prompt, in file order, and the counts {rows, repeated, conflicting}."""
    kept, truths = [], {}
    rows = conflicting = 0
    for batch, total in read_batches(path):
        for row in batch:
            text, truth = checked(row, rows, path)
            rows += 1
            if text in truths:
                conflicting += truths[text] != truth
                continue
            if max_rows is not None and len(kept) >= max_rows:
                continue
            truths[text] = truth
            kept.append(row)
        print(f"dapo_math: read {rows} of {total} rows, {len(kept)} distinct prompts", file=sys.stderr, flush=True)
    return kept, {"rows": rows, "repeated": rows - len(kept), "conflicting": conflicting}


def official_layout(row: dict, split: str) -> dict:
    """The row as the official file has it, extra_info.split added (a column beyond the layout is dropped)."""
    extra = dict(row.get("extra_info") or {})
    extra["split"] = split
    reward = row["reward_model"]
    return {"data_source": row["data_source"],
            "prompt": [{"role": m["role"], "content": m["content"]} for m in row["prompt"]],
            "ability": row.get("ability", "MATH"),
            "reward_model": {"ground_truth": str(reward["ground_truth"]), "style": reward.get("style", "rule")},
            "extra_info": extra}


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="dapo_math.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--input", required=True, help="the official .parquet file (or a .jsonl of the same rows)")
    p.add_argument("--out-dir", required=True, help="where <split>.<format> (and val.<format>) are written")
    p.add_argument("--split", default="train", help="the output file's name (default train; test for AIME)")
    p.add_argument("--val-size", type=int, default=0, help="also hold out this many distinct prompts as val")
    p.add_argument("--seed", type=int, default=0, help="draws the --val-size prompts")
    p.add_argument("--format", choices=FORMATS, default="parquet")
    p.add_argument("--max-rows", type=int, default=None, help="keep the first N distinct prompts")
    args = p.parse_args(argv)
    try:
        if args.val_size < 0 or (args.max_rows is not None and args.max_rows < 1):
            raise PrepError("--val-size must be >= 0 and --max-rows >= 1")
        kept, counts = distinct_rows(args.input, args.max_rows)
        if args.val_size >= len(kept):
            raise PrepError(f"--val-size {args.val_size} leaves no {args.split} rows: the file has {len(kept)} "
                            f"distinct prompts")
        if counts["conflicting"]:
            print(f"dapo_math: warning: {counts['conflicting']} repeated rows had another ground truth than their "
                  "prompt's first row; the first row's is kept", file=sys.stderr)
        held = set(random.Random(args.seed).sample(range(len(kept)), args.val_size)) if args.val_size else set()
        train = [official_layout(r, args.split) for i, r in enumerate(kept) if i not in held]
        val = [official_layout(r, "val") for i, r in enumerate(kept) if i in held]  # file order in both
        os.makedirs(args.out_dir, exist_ok=True)
        written = write_split(train, args.out_dir, args.split, args.format)
        print(f"dapo_math: {counts['rows']} rows, {len(kept)} distinct prompts ({counts['repeated']} repeated rows "
              f"dropped)")
        print(f"dapo_math: {len(train)} {args.split} rows -> {written}")
        if val:
            print(f"dapo_math: {len(val)} val rows -> {write_split(val, args.out_dir, 'val', args.format)}")
    except PrepError as e:
        print(f"dapo_math.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
