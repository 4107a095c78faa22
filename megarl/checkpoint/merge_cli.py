"""`megarl merge` on the command line (also `python -m megarl.checkpoint.merge_cli` and tools/merge_to_hf.py): the
arguments, the merge (megarl.checkpoint.merge), its one-line report and, with --verify, the parity check of the merged
directory (megarl.checkpoint.merge_verify). Refusals print one line and exit 1.
"""
from __future__ import annotations

import sys

from megarl.bridge.hf_config import BridgeError
from megarl.checkpoint.dcp_reader import CheckpointError
from megarl.checkpoint.merge import OUTPUT_DTYPES, MergeError, merge


def add_arguments(p) -> None:
    p.add_argument("--ckpt", required=True, help="step_<N> directory, or a run / checkpoints directory (latest)")
    p.add_argument("--out", required=True, help="HF model directory to write")
    p.add_argument("--model", default="actor", choices=["actor", "critic"],
                   help="which model (critic: a *ForSequenceClassification value model, head `score.weight`)")
    p.add_argument("--hf-config", default=None, help="HF model directory the run started from (default: the run's "
                   "model.path)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors shard (default 5GB)")
    p.add_argument("--dtype", default=None, choices=sorted(OUTPUT_DTYPES),
                   help="output dtype (default: the checkpoint's)")
    p.add_argument("--verify", action="store_true", help="compare transformers logprobs with the checkpoint's "
                   "megatron model")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.add_argument("--lora", default="merged", choices=["merged", "adapter"],
                   help="a LoRA actor's checkpoint: merged = HF weights base + alpha/rank * B A (default); adapter = a "
                   "PEFT adapter directory (adapter_config.json + adapter_model.safetensors) for the run's base model")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args) -> int:
    try:
        report = merge(args.ckpt, args.out, model=args.model, hf_config=args.hf_config,
                       max_shard_size=args.max_shard_size, dtype=args.dtype, force=args.force,
                       progress=not args.no_progress, lora=args.lora)
        print(f"merged {report.step_dir / report.model} -> {report.out}: {report.tensors} tensors, "
              f"{report.bytes / 1e9:.3f} GB ({report.dtype}) in {report.seconds:.3f} s ({report.gb_per_s:.2f} GB/s)",
              file=sys.stderr)
        if args.verify and args.lora == "adapter" and (report.out / "adapter_config.json").exists():
            raise MergeError("--verify compares HF weights; for a PEFT adapter directory run "
                             "`megarl verify --hf BASE --lora DIR`")
        if args.verify:
            from megarl.checkpoint.merge_verify import verify_merge

            diff = verify_merge(report)
            print(f"verify: max |{'value' if report.model == 'critic' else 'logprob'} diff| transformers vs megatron "
                  f"= {diff:.2e}", file=sys.stderr)
    except (CheckpointError, BridgeError) as exc:
        print(f"megarl merge: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="megarl merge", description="Merge a megarl checkpoint (any TP/PP/EP layout) "
                                "into a Hugging Face model directory, streaming, on one process without GPUs.")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
