"""`megarl validate` over image prompts (megarl.data.images): every row of the data files with an images column is
read, each image decoded, and every bad row reported with its file, row and reason; images beside a text-only model
are refused (its tokenizer would read `<image>` as text and the pixels would be dropped)."""
from __future__ import annotations

import os

from megarl.bridge.checks import model_config
from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig
from megarl.data.dataset import DataError, read_rows
from megarl.data.images import row_image_problem

SHOWN = 5  # bad rows listed per file; the count says how many more


def check_image_rows(cfg: MegarlConfig) -> list[Issue]:
    d = cfg.data
    issues = []
    hf = None  # the model's config.json, read once, at the first file with images
    for section, files in (("data.train_files", d.train_files), ("data.val_files", d.val_files)):
        for i, path in enumerate(files):
            if not os.path.isfile(path):
                continue  # check_paths names it
            if path.endswith(".parquet") and not _has_column(path, d.image_key):
                continue  # a text-only file: its rows are not read here (a training file can hold millions)
            try:
                rows = read_rows(path)
            except DataError:
                continue  # the loader's own error is check_paths' and check_data_files'
            with_images = [r for r, row in enumerate(rows) if row.get(d.image_key) is not None]
            if not with_images:
                continue
            key = f"{section}[{i}]"
            hf = hf if hf is not None else (model_config(cfg)[0] or {})
            if hf and "vision_config" not in hf:
                issues.append(Issue(key, path, f"{len(with_images)} row(s) have images (column {d.image_key!r}) but "
                                    f"the model ({(hf.get('architectures') or ['?'])[0]}) reads text only",
                                    "use a vision-language model (Qwen2.5-VL), or drop the images column",
                                    keys=(section, "data.image_key", "model.path")))
            base = os.path.dirname(os.path.abspath(path))
            bad = [(r, p) for r in with_images
                   if (p := row_image_problem(rows[r][d.prompt_key] if d.prompt_key in rows[r] else "",
                                              rows[r][d.image_key], base)) is not None]
            if bad:
                listed = "; ".join(f"row {r}: {p}" for r, p in bad[:SHOWN])
                more = f"; and {len(bad) - SHOWN} more row(s)" if len(bad) > SHOWN else ""
                issues.append(Issue(key, path, f"{len(bad)} of {len(with_images)} image row(s) cannot be used: "
                                    f"{listed}{more}", "fix or drop those rows (docs/data.md#image-prompts)",
                                    keys=(section, "data.image_key")))
    return issues


def _has_column(path: str, column: str) -> bool:
    """Whether a parquet file has `column`, from its schema alone (an unreadable file: True, the read reports it)."""
    import pyarrow.parquet as pq

    try:
        return column in pq.read_schema(path).names
    except Exception:  # noqa: BLE001 - pyarrow raises several types for a damaged file
        return True
