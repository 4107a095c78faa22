"""Prompt data: files -> typed records -> token ids -> deterministic, resumable, DP-sharded batches.

    records = load_prompts_from_config(cfg.data, "train", require_data_source=cfg.reward.reward_fn is None)
    records, ids, report = encode_prompts(records, tokenizer, cfg.rollout.prompt_length, cfg.data.truncation,
                                          cfg.data.apply_chat_template)
    loader = PromptLoader(records, seed=cfg.trainer.seed, shuffle=cfg.data.shuffle, drop_last=cfg.data.drop_last)
    batch = shard(loader.next_batch(cfg.data.train_batch_size), dp_rank, dp_size)

`synthetic` makes the arithmetic task and word-level tokenizer of the tiny CPU demo.
"""
from megarl.data.dataset import (DataError, PromptRecord, load_prompts, load_prompts_from_config, read_rows,
                                 records_from_rows)
from megarl.data.encode import encode_one, encode_prompts, format_report
from megarl.data.loader import PromptLoader, epoch_order, shard, val_batches
from megarl.data.synthetic import arithmetic_tokenizer, make_arithmetic_dataset, write_dataset

__all__ = [
    "DataError", "PromptRecord", "load_prompts", "load_prompts_from_config", "read_rows", "records_from_rows",
    "encode_one", "encode_prompts", "format_report",
    "PromptLoader", "epoch_order", "shard", "val_batches",
    "arithmetic_tokenizer", "make_arithmetic_dataset", "write_dataset",
]
