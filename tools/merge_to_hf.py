#!/usr/bin/env python
"""Merge a megarl checkpoint (any TP/PP/EP layout) into a Hugging Face model directory.

A thin wrapper of `megarl merge` (megarl.checkpoint.merge_cli), for environments without the console script:

    python tools/merge_to_hf.py --ckpt runs/exp/checkpoints/step_100 --out exp_hf [--model critic] [--verify]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megarl.checkpoint.merge_cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
