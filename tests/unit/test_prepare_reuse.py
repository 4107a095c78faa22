"""Generated inputs (synthetic data, the tiny model, the SFT model) are reused by later runs, and a run that asks for
other settings than the ones they were made with is told so, naming each setting."""
import json
import logging
from pathlib import Path
from types import SimpleNamespace

from megarl.prepare import MADE_FILE, note_reuse, prepare, record_made
from megarl.sft import sft_model_path, sft_settings
from megarl.validate import load_config

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "grpo_tiny_cpu.yaml"


def _cfg(tmp_path, *overrides):
    return load_config(RECIPE, [f"trainer.run_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'init'}",
                                "data.synthetic.num_train=8", "data.synthetic.num_val=4", *overrides])


def _messages(caplog, level):
    return [r.getMessage() for r in caplog.records if r.name == "megarl" and r.levelno == level]


def test_note_reuse_names_each_setting_that_differs(tmp_path, caplog):
    record_made(tmp_path, {"trainer.seed": 1, "sft.total_steps": 150, "sft.optim.lr": 0.002})
    caplog.set_level(logging.INFO, logger="megarl")
    note_reuse(tmp_path, {"trainer.seed": 1, "sft.total_steps": 150, "sft.optim.lr": 0.002}, "sft", "sft.output_dir")
    assert _messages(caplog, logging.WARNING) == []
    assert any("same settings" in m for m in _messages(caplog, logging.INFO))
    caplog.clear()
    note_reuse(tmp_path, {"trainer.seed": 2, "sft.total_steps": 150, "sft.optim.lr": 0.001}, "sft", "sft.output_dir")
    [warning] = _messages(caplog, logging.WARNING)
    assert "trainer.seed=1 (this run: 2)" in warning and "sft.optim.lr=0.002 (this run: 0.001)" in warning
    assert "sft.total_steps" not in warning and "sft.output_dir" in warning and str(tmp_path) in warning


def test_a_directory_made_before_settings_were_recorded_is_said_to_be_reused(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megarl")
    note_reuse(tmp_path, {"trainer.seed": 1}, "tiny model", "model.path")
    assert _messages(caplog, logging.WARNING) == []
    assert any("before its settings were recorded" in m for m in _messages(caplog, logging.INFO))


def test_prepare_records_and_a_new_seed_is_warned_about(tmp_path, caplog):
    prepare(_cfg(tmp_path), is_rank0=True)
    made_model = json.loads((tmp_path / "init" / MADE_FILE).read_text())
    made_data = json.loads((tmp_path / "run" / "data" / MADE_FILE).read_text())
    assert made_model["trainer.seed"] == 1 and made_model["model.create_tiny.hidden_size"] == 128
    assert made_data["data.synthetic.num_train"] == 8 and "data.synthetic.output_dir" not in made_data

    caplog.set_level(logging.INFO, logger="megarl")
    prepare(_cfg(tmp_path), is_rank0=True)  # the same settings: reused quietly
    assert _messages(caplog, logging.WARNING) == []
    prepare(_cfg(tmp_path, "trainer.seed=2"), is_rank0=True)
    warnings = _messages(caplog, logging.WARNING)
    assert len(warnings) == 2
    assert any("tiny model" in w and "trainer.seed=1 (this run: 2)" in w and "model.path" in w for w in warnings)
    assert any("synthetic data" in w and "data.synthetic.output_dir" in w for w in warnings)


def test_a_reused_sft_model_made_with_fewer_steps_is_warned_about(tmp_path, caplog):
    made, later = _cfg(tmp_path, "sft.total_steps=150"), _cfg(tmp_path, "sft.total_steps=300")
    out = tmp_path / "run" / "sft_model"  # a stand-in: validate would refuse a directory without a model
    out.mkdir(parents=True)
    record_made(out, sft_settings(made))
    caplog.set_level(logging.INFO, logger="megarl")
    rank0 = SimpleNamespace(is_rank0=True)
    assert sft_model_path(made, rank0) == str(out)  # exists: not trained again
    assert _messages(caplog, logging.WARNING) == []
    assert sft_model_path(later, rank0) == str(out)
    [warning] = _messages(caplog, logging.WARNING)
    assert "sft.total_steps=150 (this run: 300)" in warning and "sft.output_dir" in warning
