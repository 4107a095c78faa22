"""`megarl validate` rules of the prompt data: file types the loaders read and the synthetic tasks' ranges."""
from __future__ import annotations

from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig
from megarl.data.synthetic import CHAIN_MAX_TERMS, arithmetic_vocab


def check_data_files(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for section, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
                           ("sft.train_files", cfg.sft.train_files)):
        for i, f in enumerate(files):
            if not f.endswith((".parquet", ".jsonl", ".json")):
                issues.append(Issue(f"{section}[{i}]", f, "unsupported file type", "use .parquet or .jsonl",
                                    keys=(section,)))
    return issues


def check_synthetic(cfg: MegarlConfig) -> list[Issue]:
    syn, key = cfg.data.synthetic, "data.synthetic.max_operand"
    if syn is None:
        return []
    if syn.task == "arithmetic" and syn.max_operand > 60:
        return [Issue(key, syn.max_operand, "the arithmetic task's tokenizer has one token per number up to "
                      "2 * max_operand, kept under 128 numbers", "use at most 60", keys=(key, "data.synthetic.task"))]
    if syn.task == "chain" and len(arithmetic_vocab(syn.max_operand, "chain")) >= 300:
        return [Issue(key, syn.max_operand, f"the chain task's tokenizer has one token per number up to "
                      f"{CHAIN_MAX_TERMS} * max_operand, kept under 300 tokens", "use at most 17",
                      keys=(key, "data.synthetic.task"))]
    if syn.task != "multiply_tool" and syn.direct_answer_share:
        share = "data.synthetic.direct_answer_share"
        return [Issue(share, syn.direct_answer_share, "only the multiply_tool task has tool-free demonstrations",
                      "remove it or set data.synthetic.task: multiply_tool", keys=(share, "data.synthetic.task"))]
    if syn.task == "multiply_tool" and syn.max_operand < 32:
        return [Issue(key, syn.max_operand, "multiply_tool draws operands from [32, max_operand]", "use at least 32",
                      keys=(key, "data.synthetic.task"))]
    return []
