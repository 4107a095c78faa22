"""Metrics sinks: `<run_dir>/metrics.jsonl` (one JSON object per step), tensorboard event files, a console line.

Only global rank 0 writes. Values must be plain numbers; tensors are converted, NaN is written as null in jsonl.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Optional

# The console line shows these, in this order, when present.
CONSOLE_KEYS = ("sft/loss", "train/reward_mean", "val/reward_mean", "actor/pg_loss", "actor/kl", "actor/entropy",
                "actor/grad_norm", "critic/vf_loss", "train/response_length_mean", "rollout/logprob_abs_diff_mean",
                "timing/step_s")


def _number(value) -> Optional[float]:
    if hasattr(value, "item"):
        value = value.item()
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


class MetricsLogger:
    def __init__(self, run_dir: str | Path, jsonl: bool = True, tensorboard: bool = True, console: bool = True,
                 enabled: bool = True, resume_step: int = 0):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.console = console and enabled
        self._jsonl = None
        self._tb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if jsonl:
            path = self.run_dir / "metrics.jsonl"
            if resume_step and path.exists():  # a resumed run must not repeat steps a crash left after the checkpoint
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line)["step"] <= resume_step]
                path.write_text("".join(line + "\n" for line in kept))
            self._jsonl = path.open("a" if resume_step else "w")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=resume_step + 1 or None)
        self._start = time.monotonic()

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {k: _number(v) for k, v in sorted(metrics.items())}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, **clean}) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in clean.items():
                if value is not None:
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self.console:
            shown = " ".join(f"{k.split('/', 1)[1]}={clean[k]:.4g}" for k in CONSOLE_KEYS
                             if clean.get(k) is not None)
            print(f"[step {step}] {shown}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()


# Per-round metrics whose name says they are an average over samples; every other one is a count or a duration.
_MEAN_SUFFIXES = ("_mean", "_frac", "_fraction")


def combine_round_metrics(rounds: list[tuple[dict, int]]) -> dict:
    """One set of metrics for several generation rounds of a step (DAPO dynamic sampling), given each round's metrics
    and sample count: means and fractions weighted by samples, counts and seconds summed, tokens per second as total
    tokens over total generation time."""
    out: dict = {}
    for key in dict.fromkeys(k for metrics, _ in rounds for k in metrics):
        present = [(float(m[key]), n) for m, n in rounds if key in m]
        if key.endswith(_MEAN_SUFFIXES):
            weight = sum(n for _, n in present)
            out[key] = sum(v * n for v, n in present) / weight if weight else 0.0
        else:
            out[key] = sum(v for v, _ in present)
    if "rollout/tokens_per_second" in out:
        seconds = out.get("rollout/generate_seconds", 0.0)
        out["rollout/tokens_per_second"] = out.get("rollout/response_tokens", 0.0) / seconds if seconds > 0 else 0.0
    return out


def write_rollouts(path: Path, records, rollout, batch: dict, scores, tokenizer) -> None:
    """logging.save_rollouts: one JSON line per sample of the step with the prompt and response text, the reward, the
    per-token advantages of the response tokens, and what identifies the prompt (data_source, ground_truth, uid)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for i in range(len(rollout)):
            rec = records[int(rollout.prompt_index[i])]
            mask = batch["response_mask"][i].bool()
            row = {"prompt_index": int(rollout.prompt_index[i]), "uid": rec.uid, "data_source": rec.data_source,
                   "prompt": tokenizer.decode(list(rollout.prompt_ids[i]), skip_special_tokens=True),
                   "response": tokenizer.decode(list(rollout.response(i)), skip_special_tokens=True),
                   "ground_truth": rec.ground_truth, "reward": float(scores[i]),
                   "advantages": [round(float(a), 6) for a in batch["advantages"][i][mask]],
                   "response_length": int(rollout.response_lengths[i]), "finish_reason": rollout.finish_reasons[i]}
            f.write(json.dumps(row, default=str) + "\n")
    tmp.replace(path)
