"""Metrics sinks: `<run_dir>/metrics.jsonl` (one JSON object per step), tensorboard event files, wandb (optional),
and the terminal: a line for reported steps (a live progress line in between on a TTY) and a summary at the end.
A response-health flag (megarl.report.health_flags) is logged as a warning the step it first fires.

Real responses for `megarl report`: a few train samples of the run's first and latest step (`samples.jsonl`) and
each validation's first trainer.log_val_generations generations (`val_generations.jsonl`, also in the run's log).

Only global rank 0 writes. Values must be plain numbers; tensors are converted, NaN is written as null in jsonl.
"""
from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from megarl.console import LOG_ONLY, say, terminal
from megarl.report import (ENTROPY_KEY, HEALTH_KINDS, LENGTH_KEY, SAMPLES_FILE, TRUNCATED_KEY, VAL_GENERATIONS_FILE,
                           health_flags, read_jsonl, shorten, summary_lines)

if TYPE_CHECKING:
    from megarl.config.schema import WandbConfig

# The terminal line shows these, in this order, when present, under their full names (train/ vs val/ is explicit).
CONSOLE_KEYS = ("sft/loss", "rm/loss", "rm/accuracy", "rm/val_accuracy", "rm/val_margin", "train/reward_mean",
                "val/reward_mean", "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm",
                "critic/vf_loss", "train/response_length_mean", "timing/step_s")
# Kept in memory for the end-of-run summary and the health flags (everything else is in metrics.jsonl).
_SUMMARY_PREFIXES = ("train/reward_mean", "val/reward_mean", "sft/loss", "timing/", TRUNCATED_KEY, LENGTH_KEY,
                     ENTROPY_KEY)
log = logging.getLogger("megarl.metrics")
run_log = logging.getLogger(LOG_ONLY + ".samples")  # the run's log file only: not the terminal of a quiet run
LOGGED_CHARS = 300  # a prompt or response in the log is cut to this (the jsonl files keep it whole)
REPORTS_PER_RUN = 6  # terminal lines per run besides the first, last and validation steps


def _write_jsonl(path: Path, rows: Sequence[dict]) -> None:
    """Replace `path` with one JSON line per row, atomically (a crash leaves the old file or the new one)."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    tmp.replace(path)


def generation_line(row: dict) -> str:
    """One line for the log from a val_generations.jsonl row: score, ground truth, prompt and response as Python
    string literals (newlines escaped), each cut to LOGGED_CHARS."""
    return (f"score {row['score']:.3g}  ground truth {shorten(str(row.get('ground_truth')), 80)!r}  "
            f"prompt {shorten(row['prompt'], LOGGED_CHARS)!r}  response {shorten(row['response'], LOGGED_CHARS)!r}")


def _number(value) -> Optional[float]:
    if hasattr(value, "item"):
        value = value.item()
    value = float(value)
    return None if math.isnan(value) or math.isinf(value) else value


def console_line(step: int, total: Optional[int], metrics: dict) -> str:
    """`step  25/150  train/reward_mean 0.406  val/reward_mean 0.453  ...` from a step's clean metrics."""
    where = f"{step:>{len(str(total))}}/{total}" if total else str(step)
    shown = "  ".join(f"{k} {metrics[k]:.3g}" for k in CONSOLE_KEYS if metrics.get(k) is not None)
    return f"step {where}  {shown}"


def start_wandb(wandb_cfg: "WandbConfig", run_dir: Path, config: Optional[dict]):
    """A wandb run writing under run_dir/wandb (offline with mode=offline or WANDB_MODE=offline)."""
    try:
        import wandb
    except ImportError:
        raise RuntimeError("logging.wandb.enable = true needs the wandb package: pip install 'megarl[wandb]' "
                           "(or set logging.wandb.enable=false)") from None
    return wandb.init(project=wandb_cfg.project, name=wandb_cfg.name or run_dir.resolve().name,
                      entity=wandb_cfg.entity, mode=wandb_cfg.mode, dir=str(run_dir), config=config)


class MetricsLogger:
    def __init__(self, run_dir: str | Path, jsonl: bool = True, tensorboard: bool = True, console: bool = True,
                 enabled: bool = True, resume_step: int = 0, total_steps: Optional[int] = None, wandb=None,
                 config: Optional[dict] = None, summary: bool = True, response_length: Optional[int] = None,
                 samples: bool = False):
        """total_steps paces the terminal lines (None: a line per step); wandb: a WandbConfig (logging.wandb);
        config: the resolved recipe, recorded with the wandb run; summary: print the run's summary at close;
        response_length: rollout.response_length, the length cap the health flags compare with; samples: this
        logger writes the run's samples.jsonl and val_generations.jsonl (a fresh run starts them empty, a resumed
        one keeps what its steps up to resume_step wrote)."""
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self.console = console and enabled
        self.summary = summary
        self.total_steps = total_steps
        self.response_length = response_length
        self._every = max(1, total_steps // REPORTS_PER_RUN) if total_steps else 1
        self._last_reported: Optional[int] = None
        self._history: list[dict] = []
        self._flagged: set[str] = set()  # health flag kinds already warned about
        self._first_samples: list[dict] = []
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if samples:
            self._start_sample_files(resume_step)
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
        if wandb is not None and wandb.enable:
            self._wandb = start_wandb(wandb, self.run_dir, config)
        self._start = time.monotonic()

    @classmethod
    def for_run(cls, cfg, enabled: bool, resume_step: int = 0) -> "MetricsLogger":
        """The RL run's sinks, as the recipe's logging section asks."""
        lg = cfg.logging
        return cls(cfg.trainer.run_dir, lg.jsonl, lg.tensorboard, lg.console, enabled=enabled, resume_step=resume_step,
                   total_steps=cfg.trainer.total_steps, wandb=lg.wandb, config=cfg.model_dump(),
                   response_length=cfg.rollout.response_length, samples=True)

    def _start_sample_files(self, resume_step: int) -> None:
        """A fresh run must not show an earlier run's responses from the same run_dir; a resumed one keeps its own
        (its first step's samples stay the first, validations after resume_step are done again)."""
        samples, generations = self.run_dir / SAMPLES_FILE, self.run_dir / VAL_GENERATIONS_FILE
        if not resume_step:
            samples.unlink(missing_ok=True)
            generations.unlink(missing_ok=True)
            return
        rows = [r for r in read_jsonl(samples) if r["step"] <= resume_step]
        first = min((r["step"] for r in rows), default=None)
        self._first_samples = [r for r in rows if r["step"] == first]
        _write_jsonl(samples, self._first_samples)
        if generations.exists():
            _write_jsonl(generations, [r for r in read_jsonl(generations) if r["step"] <= resume_step])

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
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in clean.items() if v is not None}, step=step)
        self._history.append({"step": step, **{k: v for k, v in clean.items()
                                               if v is not None and k.startswith(_SUMMARY_PREFIXES)}})
        if self.console:
            self._print(step, clean)
        self._warn_health()

    def _warn_health(self) -> None:
        """A warning (log and terminal) for each health flag the first step it fires; never again for its kind."""
        if len(self._flagged) == len(HEALTH_KINDS):  # all said: no need to scan the whole history again each step
            return
        for flag in health_flags(self._history, self.response_length):
            if flag.kind not in self._flagged:
                self._flagged.add(flag.kind)
                log.warning(flag.line())

    def log_samples(self, step: int, rows: Sequence[dict]) -> None:
        """A few train samples of `step` (dicts: prompt, response, score, ...; megarl.steps.sample_rows): samples.jsonl
        holds the first step's and the latest step's, rewritten each step (a few lines: nothing to keep growing)."""
        if not self.enabled or not rows:
            return
        rows = [{"step": step, **r} for r in rows]
        if not self._first_samples:
            self._first_samples = rows
        latest = rows if self._first_samples[0]["step"] != step else []
        _write_jsonl(self.run_dir / SAMPLES_FILE, self._first_samples + latest)

    def log_val_generations(self, step: int, rows: Sequence[dict]) -> None:
        """A validation's first generations (trainer.log_val_generations): appended to val_generations.jsonl, a line
        each in the run's log (the rank's log file, not the terminal of a quiet run)."""
        if not self.enabled or not rows:
            return
        rows = [{"step": step, **r} for r in rows]
        with (self.run_dir / VAL_GENERATIONS_FILE).open("a") as f:
            f.write("".join(json.dumps(r, default=str) + "\n" for r in rows))
        for i, row in enumerate(rows):
            run_log.info("validation at step %d, generation %d of %d: %s", step, i + 1, len(rows), generation_line(row))

    def _reported(self, step: int, clean: dict) -> bool:
        """The first logged step, step 1, the last step, validation steps, and the first step logged past each
        multiple of total_steps / REPORTS_PER_RUN (SFT logs only every few steps)."""
        last = self._last_reported
        return (last is None or step in (1, self.total_steps) or step // self._every > last // self._every
                or any(k.startswith("val/") for k in clean))

    def _print(self, step: int, clean: dict) -> None:
        line = console_line(step, self.total_steps, clean)
        out = terminal()
        if self._reported(step, clean):
            self._last_reported = step
            say(line)
        elif out.isatty():  # a progress line rewritten in place until the next reported step
            out.write("\r\x1b[K" + line[:200])
            out.flush()

    def close(self) -> None:
        if self.console and self.summary and self._history:
            for line in summary_lines(self._history, time.monotonic() - self._start, self.response_length):
                say(line)
            if (self.run_dir / "metrics.jsonl").exists():
                say(f"curves: megarl report {self.run_dir}")
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


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
            components = getattr(rollout, "reward_components", None)  # reward.components / the reward model
            if components:
                row["reward_components"] = {k: float(v[i]) for k, v in components.items()}
            f.write(json.dumps(row, default=str) + "\n")
    tmp.replace(path)
