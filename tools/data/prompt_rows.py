"""What the data tools in tools/data/ share: the GSM8K instruction, one prompt row, and the writer.

One row, in verl's layout (examples/data_preprocess/gsm8k.py), which megarl.data.load_prompts reads unchanged:

    data_source   "openai/gsm8k"         megarl's registered gsm8k rule scores it (the number after the last '####')
    prompt        [{"role": "user", "content": question + " " + INSTRUCTION}]
    ability       "math"
    ground_truth  "72"                   the final answer as a string, no commas
    reward_model  {"style": "rule", "ground_truth": "72"}   verl keeps the answer here; megarl reads either place
    extra_info    {"split": ..., "index": ..., "question": ..., "answer": ..., **tool-specific keys}
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # the tools run from a checkout, next to the package they feed
    sys.path.insert(0, str(ROOT))

from megarl.data import write_dataset  # noqa: E402

# verl's exact wording, so a model trained on verl's gsm8k data sees the prompt it was trained on
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
DATA_SOURCE = "openai/gsm8k"
FORMATS = ("parquet", "jsonl")


class PrepError(ValueError):
    """An input problem the user can fix; the message names the file, line or value and what to do."""


def prompt_row(question: str, ground_truth: str, split: str, index: int, answer: str,
               **extra: Any) -> dict[str, Any]:
    """One row (the layout in this module's docstring); `extra` goes into extra_info beside split, index, question
    and answer (the worked solution ending in '#### N')."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question} {INSTRUCTION}"}],
        "ability": "math",
        "ground_truth": ground_truth,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "question": question, "answer": answer, **extra},
    }


def write_split(rows: Sequence[dict[str, Any]], out_dir: str, name: str, fmt: str) -> str:
    """Write rows to out_dir/name.<fmt> (parquet or jsonl), atomically; returns the path."""
    if fmt not in FORMATS:
        raise PrepError(f"unknown format {fmt!r}; use one of {', '.join(FORMATS)}")
    if not rows:
        raise PrepError(f"no rows for {name}.{fmt}: nothing would be written (check the inputs and --max-rows)")
    return write_dataset(list(rows), os.path.join(out_dir, f"{name}.{fmt}"))


def prepare_splits(name: str, sources: dict, read, to_rows, out_dir: str, fmt: str, max_rows=None) -> int:
    """A preparation script's main: {split: source} read with `read` (None sources skipped), all before any is written
    so a bad file leaves no half-prepared directory, each cut to max_rows and written by write_split through
    to_rows(records, split); errors one line on stderr. Returns the exit code."""
    try:
        splits = {split: read(source)[:max_rows] for split, source in sources.items() if source}
        for split, records in splits.items():
            path = write_split(to_rows(records, split), out_dir, split, fmt)
            print(f"{name}: {len(records)} {split} rows -> {path}")
    except PrepError as e:
        print(f"{name}.py: error: {e}", file=sys.stderr)
        return 1
    return 0
