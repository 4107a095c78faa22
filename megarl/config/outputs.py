"""Where a run writes what it makes (data, SFT and reward models, preference pairs): pure functions of the config, read
by the commands that write these and by validate's path rules (megarl.validate.paths)."""
from __future__ import annotations

from pathlib import Path

from megarl.config.schema import MegarlConfig


def data_dir(cfg: MegarlConfig) -> Path:
    """Where generated data goes: data.synthetic.output_dir, else <run_dir>/data."""
    syn = cfg.data.synthetic
    return Path(syn.output_dir) if syn is not None and syn.output_dir else Path(cfg.trainer.run_dir) / "data"


def synthetic_paths(cfg: MegarlConfig) -> dict[str, Path]:
    out = data_dir(cfg)
    paths = {"train": out / "train.parquet", "val": out / "val.parquet"}
    if cfg.data.synthetic.num_sft:
        paths["sft"] = out / "sft.parquet"
    return paths


def sft_output_dir(cfg: MegarlConfig) -> Path:
    return Path(cfg.sft.output_dir or Path(cfg.trainer.run_dir) / "sft_model")


def rm_output_dir(cfg: MegarlConfig) -> Path:
    return Path(cfg.rm.output_dir or Path(cfg.trainer.run_dir) / "rm_model")


def pair_paths(cfg: MegarlConfig) -> dict[str, Path]:
    """Where the synthetic task's preference pairs are written (data.synthetic with empty rm.train_files)."""
    out = data_dir(cfg)
    return {"train": out / "pairs_train.parquet", "val": out / "pairs_val.parquet"}


def policy_pair_paths(cfg: MegarlConfig) -> dict[str, Path]:
    """Where the preference pairs from the SFT policy's own samples are written (rm.policy_pairs)."""
    out = data_dir(cfg)
    return {"train": out / "policy_pairs_train.parquet", "val": out / "policy_pairs_val.parquet"}
