"""Prompt datasets: .parquet / .jsonl files -> a list of typed `PromptRecord`s.

One row of a prompt file (the verl layout, so existing datasets load unchanged):

    prompt        list of chat messages [{"role": ..., "content": ...}] or a plain string   (data.prompt_key)
    data_source   which reward function scores the row, e.g. "openai/gsm8k"               (data.data_source_key)
    ground_truth  reference answer; also found nested as reward_model.ground_truth        (data.ground_truth_key)
    extra_info    optional dict handed to the reward function unchanged                   (data.extra_info_key)
    response      optional SFT target text                                                 (data.response_key)

Every error names the file, the row or column, what exists, and the setting to change.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Sequence, Union

SUPPORTED_EXTENSIONS = (".parquet", ".jsonl")

# verl datasets keep the reference answer inside a reward_model struct; used when the top-level column is absent.
NESTED_GROUND_TRUTH = ("reward_model", "ground_truth")

Message = dict[str, str]


class DataError(ValueError):
    """A dataset problem the user can fix: the message names the file, the row or column, and the fix."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt, as the rest of the pipeline sees it.

    index: position in the concatenated dataset (0..N-1); the loader shuffles these.
    uid: "<file name>#<row>", stable across runs; used in error messages and to group a prompt's samples.
    prompt: chat messages (list of {"role", "content"}) or plain text.
    prompt_ids: token ids, set by `encode_prompts` (None before encoding).
    images: the row's images (megarl.data.images: encoded bytes or paths), one per `<image>` placeholder, in order.
    """

    index: int
    uid: str
    prompt: Union[list[Message], str]
    data_source: str = ""
    ground_truth: Any = None
    extra_info: dict[str, Any] = field(default_factory=dict)
    response: Optional[Union[str, list[Message]]] = None
    prompt_ids: Optional[tuple[int, ...]] = None
    images: tuple = ()

    @property
    def is_chat(self) -> bool:
        return not isinstance(self.prompt, str)


# ----------------------------------------------------------------------------------------------------------------------
# Reading files


def read_rows(path: str) -> list[dict[str, Any]]:
    """All rows of one .parquet or .jsonl file as python dicts (nested structs become dicts, lists stay lists)."""
    if not os.path.exists(path):
        raise DataError(f"dataset file not found: {path!r} (absolute: {os.path.abspath(path)!r}); "
                        f"check data.train_files / data.val_files")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        import pyarrow.parquet as pq

        try:
            return pq.read_table(path).to_pylist()
        except Exception as e:  # pyarrow raises several types for corrupt files; the user needs the file name
            raise DataError(f"cannot read parquet file {path!r}: {type(e).__name__}: {e}") from e
    if ext == ".jsonl":
        rows = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: invalid JSON ({e.msg}); each line must be one JSON "
                                    f"object") from e
                if not isinstance(row, dict):
                    raise DataError(f"{path}:{lineno}: expected a JSON object per line, got {type(row).__name__}")
                rows.append(row)
        return rows
    raise DataError(f"unsupported dataset file extension {ext!r} for {path!r}; supported: "
                    f"{', '.join(SUPPORTED_EXTENSIONS)} (convert it, e.g. with pandas.read_json(...).to_parquet(...))")


def _columns(rows: Sequence[dict[str, Any]]) -> list[str]:
    # jsonl rows may differ in keys; the union is what the user can choose from
    seen: dict[str, None] = {}
    for row in rows:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def _ground_truth_getter(columns: list[str], key: str, path: str, required: bool):
    """Where this file keeps the ground truth: top-level column, dotted path, or verl's reward_model.ground_truth."""
    if key in columns:
        return lambda row: row.get(key)
    head, _, rest = key.partition(".")
    if rest and head in columns:
        def dotted(row):
            value = row.get(head)
            for part in rest.split("."):
                value = value.get(part) if isinstance(value, dict) else None
            return value
        return dotted
    if NESTED_GROUND_TRUTH[0] in columns:
        return lambda row: (row.get(NESTED_GROUND_TRUTH[0]) or {}).get(NESTED_GROUND_TRUTH[1])
    if required:
        raise DataError(f"data.ground_truth_key={key!r} not found in {os.path.basename(path)} (nor "
                        f"{'.'.join(NESTED_GROUND_TRUTH)}); columns are {columns}; set data.ground_truth_key "
                        f"(a dotted path like 'reward_model.ground_truth' works too) [file: {path}]")
    return lambda row: None


def _check_prompt(value: Any, path: str, row: int, key: str) -> Union[list[Message], str]:
    where = f"{path} row {row} column {key!r}"
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: the prompt is an empty string")
        return value
    if isinstance(value, (list, tuple)) and value:
        messages = []
        for i, m in enumerate(value):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise DataError(f"{where}: message {i} must be a dict with string 'role' and 'content', got {m!r:.200}")
            messages.append({"role": m["role"], "content": m["content"]})
        return messages
    raise DataError(f"{where}: expected a non-empty list of chat messages or a string, got {value!r:.200}; "
                    f"set data.prompt_key to the prompt column")


def _scalar_to_str(value: Any) -> Any:
    # jsonl stores answers like 71 as numbers; reward functions compare strings, so give them one form
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return str(value)
    return value


def records_from_rows(rows: Sequence[dict[str, Any]], path: str, *, prompt_key: str = "prompt",
                      ground_truth_key: str = "ground_truth", data_source_key: str = "data_source",
                      extra_info_key: str = "extra_info", response_key: str = "response",
                      image_key: str = "images", require_ground_truth: bool = True, require_data_source: bool = False,
                      require_response: bool = False, start_index: int = 0) -> list[PromptRecord]:
    """Typed records from the rows of one file; `path` names it in messages and uids, and relative image paths
    are taken from its folder."""
    from megarl.data.images import image_refs, pairing_problem

    name = os.path.basename(path)
    if not rows:
        raise DataError(f"dataset {path!r} is empty (0 rows); check the file or remove it from data.train_files / "
                        f"data.val_files")
    columns = _columns(rows)
    required = [("data.prompt_key", prompt_key)]
    if require_data_source:
        required.append(("data.data_source_key", data_source_key))
    if require_response:
        required.append(("data.response_key", response_key))
    for setting, key in required:
        if key not in columns:
            hint = " (or set reward.reward_fn so rows need no data_source)" if setting == "data.data_source_key" else ""
            raise DataError(f"{setting}={key!r} not found in {name}; columns are {columns}; set {setting}{hint} "
                            f"[file: {path}]")
    get_gt = _ground_truth_getter(columns, ground_truth_key, path, require_ground_truth)
    records = []
    for row_no, row in enumerate(rows):
        if prompt_key not in row:
            raise DataError(f"{path} row {row_no}: no {prompt_key!r} key (data.prompt_key); keys are {list(row)}")
        prompt = _check_prompt(row[prompt_key], path, row_no, prompt_key)
        ground_truth = _scalar_to_str(get_gt(row))
        if require_ground_truth and ground_truth is None:
            raise DataError(f"{path} row {row_no}: ground truth is missing "
                            f"(data.ground_truth_key={ground_truth_key!r})")
        data_source = row.get(data_source_key)
        if data_source is None:
            if require_data_source:
                raise DataError(f"{path} row {row_no}: {data_source_key!r} is missing (data.data_source_key)")
            data_source = ""
        extra = row.get(extra_info_key) or {}
        if not isinstance(extra, dict):
            raise DataError(f"{path} row {row_no}: column {extra_info_key!r} (data.extra_info_key) must be a dict, "
                            f"got {type(extra).__name__}")
        response = row.get(response_key)
        if isinstance(response, (list, tuple)) and all(isinstance(m, dict) and m.get("role") in ("assistant", "tool")
                                                       and isinstance(m.get("content"), str) for m in response):
            response = [dict(m) for m in response]  # a multi-turn target: assistant and tool messages
        elif require_response and not isinstance(response, str):
            raise DataError(f"{path} row {row_no}: {response_key!r} (data.response_key) must be a string or a list "
                            f"of assistant/tool messages, got {response!r:.200}")
        images = ()
        if row.get(image_key) is not None:  # decoding is validate's (megarl.validate.images.check_image_rows)
            try:
                images = tuple(image_refs(row[image_key], os.path.dirname(os.path.abspath(path))))
                problem = pairing_problem(prompt, images)
            except ValueError as e:
                problem = str(e)
            if problem is not None:
                raise DataError(f"{path} row {row_no}: {problem} (data.image_key={image_key!r})")
        records.append(PromptRecord(index=start_index + row_no, uid=f"{name}#{row_no}", prompt=prompt,
                                    data_source=str(data_source), ground_truth=ground_truth, extra_info=dict(extra),
                                    response=response if isinstance(response, (str, list)) else None,
                                    images=images))
    return records


def load_prompts(paths: Union[str, Iterable[str]], *, setting: str = "data.train_files",
                 **keys: Any) -> list[PromptRecord]:
    """Read and concatenate prompt files into records indexed 0..N-1.

    keys: the column names and require_* flags of `records_from_rows`. `setting` names the config key the paths
    came from, for the error when there are none.
    """
    paths = [paths] if isinstance(paths, str) else list(paths)
    if not paths:
        raise DataError(f"{setting} is empty; set it to one or more .parquet/.jsonl files, "
                        f"e.g. {setting}=[train.parquet]")
    records: list[PromptRecord] = []
    for path in paths:
        records.extend(records_from_rows(read_rows(path), path, start_index=len(records), **keys))
    return records


def load_prompts_from_config(data_cfg: Any, split: str = "train", *, require_data_source: bool = False,
                             require_response: bool = False) -> list[PromptRecord]:
    """`load_prompts` with the file list and column names of a DataConfig; split is "train" or "val".

    require_data_source: pass True when reward.reward_fn is None, so a missing data_source column fails here
    rather than at the first reward.
    require_response: SFT data; the response column becomes required and the ground truth optional.
    """
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    files = data_cfg.train_files if split == "train" else data_cfg.val_files
    return load_prompts(files, setting=f"data.{split}_files", prompt_key=data_cfg.prompt_key,
                        ground_truth_key=data_cfg.ground_truth_key, data_source_key=data_cfg.data_source_key,
                        extra_info_key=data_cfg.extra_info_key, response_key=data_cfg.response_key,
                        image_key=data_cfg.image_key, require_ground_truth=not require_response, require_data_source=require_data_source,
                        require_response=require_response)
