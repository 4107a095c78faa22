"""docs/data.md cannot drift: every example block loads through megarl's loader and passes `megarl validate` (its
data_source routing), the column table's settings and defaults are the config's, and the routing table lists every
registered rule with its aliases."""
import re
from pathlib import Path

import pytest

from megarl.config.schema import DataConfig
from megarl.data import load_prompts
from megarl.data.encode import encode_prompts
from megarl.reward.registry import ALIASES, REGISTRY, RewardRouter
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
PAGE = (ROOT / "docs" / "data.md").read_text()
BLOCKS = re.findall(r"<!-- rows: (\w+) -->\n```jsonl\n(.*?)```", PAGE, re.DOTALL)


def _files(tmp_path, kind):
    paths = []
    for i, (k, text) in enumerate(BLOCKS):
        if k == kind:
            path = tmp_path / f"{kind}{i}.jsonl"
            path.write_text(text)
            paths.append(str(path))
    return paths


def test_the_page_has_its_examples():
    kinds = [k for k, _ in BLOCKS]
    assert kinds.count("prompts") >= 4 and kinds.count("sft") >= 1, kinds
    assert PAGE.count("```jsonl") == len(BLOCKS)  # no example block escapes the checks below


def test_prompt_examples_load_encode_and_route(tmp_path):
    from megarl.data import arithmetic_tokenizer

    records = load_prompts(_files(tmp_path, "prompts"), require_data_source=True)
    assert all(r.ground_truth is not None and isinstance(r.ground_truth, str) for r in records)
    assert {r.is_chat for r in records} == {True, False}  # text and chat prompts both shown
    RewardRouter().check(r.data_source for r in records)
    # chat prompts through a chat template, text prompts as they are
    kept, ids, report = encode_prompts(records, arithmetic_tokenizer(str(tmp_path / "tok")), prompt_length=512)
    assert report["num_kept"] == len(records) and all(ids)
    dapo = [r for r in records if r.data_source == "math_dapo"]
    assert dapo and dapo[0].ground_truth == "39"  # read from reward_model.ground_truth (no top-level column)


def test_sft_examples_load(tmp_path):
    records = load_prompts(_files(tmp_path, "sft"), require_response=True, require_ground_truth=False)
    assert {type(r.response) for r in records} == {str, list}  # a text target and a multi-turn one


def test_megarl_validate_accepts_the_prompt_examples(tmp_path):
    files = _files(tmp_path, "prompts")
    listed = "[" + ",".join(files) + "]"
    load_config(ROOT / "recipes" / "grpo_tiny_cpu.yaml", [f"data.train_files={listed}",
                                                          f"data.val_files={listed}"])


@pytest.mark.parametrize("column, setting", re.findall(r"^\| `(\w+)` \| `data\.(\w+)` \(`(?:\w+)`\)", PAGE, re.M))
def test_column_table_names_real_settings_with_their_defaults(column, setting):
    assert getattr(DataConfig(), setting) == column
    assert f"| `{column}` | `data.{setting}` (`{column}`)" in PAGE


def test_column_table_is_complete():
    keys = {k for k in DataConfig.model_fields if k.endswith("_key")}
    assert keys == set(re.findall(r"`data\.(\w+_key)`", PAGE.split("## Which rule")[0]))


def test_routing_table_lists_every_rule_and_alias():
    table = PAGE.split("## Which rule scores a row")[1].split("## Example rows")[0]
    for name in REGISTRY:
        assert f"`{name}`" in table, name
    for alias, name in ALIASES.items():
        row = next(line for line in table.splitlines() if line.startswith("| ") and f"`{name}`" in line.split("|")[1])
        assert f"`{alias}`" in row.split("|")[2] or (alias == name and "their names" in row), (alias, row)
