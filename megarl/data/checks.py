"""`megarl validate` rules of the prompt data: file types the loaders read and the synthetic tasks' ranges."""
from __future__ import annotations

from megarl.config.issues import Issue
from megarl.config.schema import MegarlConfig
from megarl.data.dataset import SUPPORTED_EXTENSIONS
from megarl.data.synthetic import CHAIN_MAX_TERMS


def check_data_files(cfg: MegarlConfig) -> list[Issue]:
    issues = []
    for section, files in (("data.train_files", cfg.data.train_files), ("data.val_files", cfg.data.val_files),
                           ("sft.train_files", cfg.sft.train_files)):
        for i, f in enumerate(files):
            if not f.endswith(SUPPORTED_EXTENSIONS):  # the loader's own list: what validate accepts, it reads
                issues.append(Issue(f"{section}[{i}]", f, f"unsupported file type (megarl reads "
                                    f"{', '.join(SUPPORTED_EXTENSIONS)})", "convert it, e.g. a .json list with "
                                    "pandas.read_json(...).to_parquet(...)", keys=(section,)))
    return issues


def check_synthetic(cfg: MegarlConfig) -> list[Issue]:
    syn, key = cfg.data.synthetic, "data.synthetic.max_operand"
    if syn is None:
        return []
    if syn.task == "arithmetic" and syn.max_operand > 60:
        return [Issue(key, syn.max_operand, "the arithmetic task's tokenizer has one token per number up to "
                      "2 * max_operand, kept under 128 numbers", "use at most 60", keys=(key, "data.synthetic.task"))]
    if syn.task == "chain" and not CHAIN_MAX_TERMS - 1 <= syn.max_operand <= 25:
        return [Issue(key, syn.max_operand, f"a chain has up to {CHAIN_MAX_TERMS} distinct terms from [0, max_operand], "
                      f"and the tokenizer one token per number up to their largest sum, kept under 300 tokens",
                      f"use {CHAIN_MAX_TERMS - 1} to 25", keys=(key, "data.synthetic.task"))]
    share = "data.synthetic.slip_share"
    if syn.slip_share and syn.task not in ("chain", "walk"):
        return [Issue(share, syn.slip_share, "only the chain and walk tasks have demonstrations that slip",
                      "remove it or set data.synthetic.task: chain or walk", keys=(share, "data.synthetic.task"))]
    if syn.slip_share and not syn.num_sft:
        return [Issue(share, syn.slip_share, "slips go into the separate SFT file only, and without "
                      "data.synthetic.num_sft SFT reads the training prompts' exact answers",
                      "set data.synthetic.num_sft (e.g. 4000)", keys=(share, "data.synthetic.num_sft"))]
    if syn.task != "multiply_tool" and syn.direct_answer_share:
        share = "data.synthetic.direct_answer_share"
        return [Issue(share, syn.direct_answer_share, "only the multiply_tool task has tool-free demonstrations",
                      "remove it or set data.synthetic.task: multiply_tool", keys=(share, "data.synthetic.task"))]
    if syn.task == "multiply_tool" and syn.max_operand < 32:
        return [Issue(key, syn.max_operand, "multiply_tool draws operands from [32, max_operand]", "use at least 32",
                      keys=(key, "data.synthetic.task"))]
    return []
