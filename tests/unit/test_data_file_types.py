"""validate accepts exactly the data files the loader reads: a .json file is refused at validate (the loader would
refuse it at start), with the types megarl reads and how to convert."""
import pytest

from megarl.config.issues import ConfigError
from megarl.data.checks import check_data_files
from megarl.data.dataset import DataError, read_rows
from megarl.validate import load_config


def test_a_json_data_file_is_refused_by_validate_as_the_loader_refuses_it(tmp_path):
    path = tmp_path / "train.json"
    path.write_text('[{"prompt": "1 + 1 =", "data_source": "x"}]')
    with pytest.raises(ConfigError, match=r"data.train_files\[0\].*unsupported file type") as refused:
        load_config("recipes/grpo_tiny_cpu.yaml", [f"data.train_files=[{path}]"])
    assert ".parquet" in str(refused.value) and "to_parquet" in str(refused.value)
    with pytest.raises(DataError):
        read_rows(str(path))
    cfg = load_config("recipes/grpo_tiny_cpu.yaml")
    ok = cfg.model_copy(update={"data": cfg.data.model_copy(update={"train_files": [str(tmp_path / "a.jsonl")]})})
    assert check_data_files(ok) == []
