"""`megarl report RUN_DIR`: the curves of a run from its metrics.jsonl, as a PNG and as a small table in the terminal.

Panels: train/val reward, response length, KL, entropy, grad norm, clip fraction and time per phase over steps.
Drawn with Pillow (no plotting library needed). `summary_lines` gives the end-of-run summary the trainer prints.
Below the table: the run's response health (`health_flags`: responses hitting the length cap, entropy blowing up;
the trainer warns with the same flags as they fire), validation accuracy apart from the answer format, and real
responses: the first and last step's samples (SAMPLES_FILE) and the first and last validation's generations
(VAL_GENERATIONS_FILE), both written by every RL run.
With several run directories (the seeds of one recipe) it reports them side by side instead: each run's validation
reward at its first and last evaluation, its best, its gain, and the range of gains over the runs, since one seed's
figure is one sample of what a recipe learns.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from statistics import fmean
from typing import Optional, Sequence

PHASES = ("rollout", "reward", "old_log_prob", "ref", "values", "train", "sync", "val")

# (panel title, [(metric key, legend label)]); a panel is drawn when at least one of its keys has a value.
PANELS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("reward", (("train/reward_mean", "train"), ("val/reward_mean", "val"))),
    ("response length (tokens)", (("train/response_length_mean", "mean"),)),
    ("KL", (("actor/kl", "actor/kl"), ("actor/kl_loss", "actor/kl_loss"))),
    ("entropy", (("actor/entropy", "actor/entropy"),)),
    ("grad norm", (("actor/grad_norm", "actor"), ("critic/grad_norm", "critic"))),
    ("clip fraction", (("actor/clip_frac", "actor/clip_frac"),)),
    ("time per phase (s)", tuple((f"timing/{p}_s", p) for p in PHASES) + (("timing/step_s", "step"),)),
    ("SFT loss", (("sft/loss", "sft/loss"),)),
)
TABLE_KEYS = ("train/reward_mean", "val/reward_mean", "train/response_length_mean", "actor/kl", "actor/entropy",
              "actor/grad_norm", "actor/clip_frac") + tuple(f"timing/{p}_s" for p in PHASES) + ("timing/step_s",)
VAL_KEY = "val/reward_mean"
SHOWN_CHARS = 600  # a response or prompt longer than this is shown as its start and end around an ellipsis
WRAP = 100  # columns of the report's wrapped text (health lines, prompts, responses)
COLORS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189), (140, 86, 75),
          (227, 119, 194), (127, 127, 127), (23, 190, 207))


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics at {path}: is {run_dir} the trainer.run_dir of a run?")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) for every row where `key` has a number."""
    return [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]


def _resolved_key(run_dir: str | Path, section: str, key: str):
    """section.key from the run's config.resolved.yaml; None where the file, the section or the key is missing."""
    import yaml

    path = Path(run_dir) / "config.resolved.yaml"
    if not path.is_file():
        return None
    try:
        return (yaml.safe_load(path.read_text()) or {}).get(section, {}).get(key)
    except (yaml.YAMLError, AttributeError):
        return None


def read_seed(run_dir: str | Path) -> Optional[int]:
    """trainer.seed from the run's config.resolved.yaml, None where the file or the key is missing."""
    seed = _resolved_key(run_dir, "trainer", "seed")
    return seed if isinstance(seed, int) else None


def read_response_length(run_dir: str | Path) -> Optional[int]:
    """rollout.response_length (the cap on generated tokens) from the run's config.resolved.yaml, None without it."""
    length = _resolved_key(run_dir, "rollout", "response_length")
    return length if isinstance(length, int) and not isinstance(length, bool) else None


def val_gain(rows: Sequence[dict], key: str = VAL_KEY) -> Optional[dict]:
    """The first and last validation of a run, its best and last - first:
    {"start": (step, value), "end": (step, value), "best": (step, value), "gain": float}; None with fewer than two
    validations. The best is the earliest step with the highest value."""
    points = series(rows, key)
    if len(points) < 2:
        return None
    best = max(points, key=lambda p: (p[1], -p[0]))
    return {"start": points[0], "end": points[-1], "best": best, "gain": points[-1][1] - points[0][1]}


def _fmt(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.3g}" if 1e-3 <= abs(value) < 1e4 else f"{value:.2e}"


# ----------------------------------------------------------------------------------------------------------------------
# Response health

TRUNCATED_KEY, LENGTH_KEY, ENTROPY_KEY = "train/truncated_frac", "train/response_length_mean", "actor/entropy"
TRUNCATED_FRAC = 0.2  # a step hits the cap when more than this share of its responses was cut ...
CAP_SHARE = 0.95  # ... or its mean length is at least this share of rollout.response_length
ENTROPY_RATIO = 2.0  # entropy blows up above this multiple of its early level ...
ENTROPY_FLOOR = 1.0  # ... and above this many nats per token (a small early entropy doubling is not a blow-up)
ENTROPY_EARLY_STEPS = 5  # the early level: the mean over the first this many steps with an entropy
PATIENCE = 3  # consecutive flagged steps before a flag is raised: one noisy step is not a trend


HEALTH_KINDS = ("length_cap", "entropy")  # every kind of Flag health_flags reports


@dataclass(frozen=True)
class Flag:
    """A response-health problem of a run: `kind` ("length_cap" or "entropy"), its first stretch of at least PATIENCE
    consecutive flagged steps (`step` .. `until`), what it is, the values that show it and what to do."""

    kind: str
    step: int
    until: int
    what: str
    values: str
    advice: str

    def line(self) -> str:
        return f"health: {self.what} from step {self.step} (through step {self.until}): {self.values}. {self.advice}"


def _first_stretch(points: Sequence[tuple[int, dict]], flagged) -> Optional[list[tuple[int, dict]]]:
    """The first run of at least PATIENCE consecutive points (in order, each (step, row)) for which flagged(row) is
    true, to its end; None when there is none."""
    stretch: list = []
    for point in points:
        if flagged(point[1]):
            stretch.append(point)
        elif len(stretch) >= PATIENCE:
            break
        else:
            stretch = []
    return stretch if len(stretch) >= PATIENCE else None


def health_flags(rows: Sequence[dict], response_length: Optional[int]) -> list[Flag]:
    """The response-health flags of a run from its metric rows (metrics.jsonl objects: "step" and metric values), at
    most one per kind, the first time each happened:

    - length_cap: for PATIENCE consecutive steps, train/truncated_frac above TRUNCATED_FRAC or
      train/response_length_mean at CAP_SHARE of `response_length` or more (rollout.response_length; None: the
      truncated share alone);
    - entropy: for PATIENCE consecutive steps after the first ENTROPY_EARLY_STEPS, actor/entropy above ENTROPY_RATIO
      times its mean over those first steps and above ENTROPY_FLOOR.

    Pure: the trainer calls it on the rows logged so far (warning once per kind as it first fires), `megarl report`
    and the end-of-run summary on the whole run."""
    flags = []
    train = [(r["step"], r) for r in rows if isinstance(r.get(TRUNCATED_KEY), (int, float))
             or isinstance(r.get(LENGTH_KEY), (int, float))]

    def at_cap(row: dict) -> bool:
        truncated, length = row.get(TRUNCATED_KEY), row.get(LENGTH_KEY)
        return ((isinstance(truncated, (int, float)) and truncated > TRUNCATED_FRAC)
                or (response_length is not None and isinstance(length, (int, float))
                    and length >= CAP_SHARE * response_length))

    stretch = _first_stretch(train, at_cap)
    if stretch is not None:
        parts = []
        for key, label in ((TRUNCATED_KEY, TRUNCATED_KEY), (LENGTH_KEY, LENGTH_KEY)):
            values = [r[key] for _, r in stretch if isinstance(r.get(key), (int, float))]
            if values:
                parts.append(f"{label} {_fmt(values[0])} -> {_fmt(values[-1])}")
        cap = f" of rollout.response_length={response_length}" if response_length is not None else ""
        flags.append(Flag(
            "length_cap", stretch[0][0], stretch[-1][0], "responses hit the length cap",
            f"{', '.join(parts)}{cap} (flagged: truncated share > {TRUNCATED_FRAC} or mean length >= "
            f"{CAP_SHARE} of the cap, {len(stretch)} steps in a row)",
            "Responses stopped ending: check that the reward gives nothing for text after the answer (a rule "
            "that reads the answer and ignores what follows pays as much for running to the cap as for ending), "
            "that the tokenizer's eos token ends the responses and is kept in the response mask, lower "
            "actor.optim.lr, or raise rollout.response_length if answers need more room"))
    entropy = [(r["step"], r) for r in rows if isinstance(r.get(ENTROPY_KEY), (int, float))]
    if len(entropy) > ENTROPY_EARLY_STEPS:
        early = fmean(r[ENTROPY_KEY] for _, r in entropy[:ENTROPY_EARLY_STEPS])
        limit = max(ENTROPY_RATIO * early, ENTROPY_FLOOR)
        stretch = _first_stretch(entropy[ENTROPY_EARLY_STEPS:], lambda r: r[ENTROPY_KEY] > limit)
        if stretch is not None:
            flags.append(Flag(
                "entropy", stretch[0][0], stretch[-1][0], "entropy blew up",
                f"{ENTROPY_KEY} {_fmt(stretch[0][1][ENTROPY_KEY])} -> {_fmt(stretch[-1][1][ENTROPY_KEY])}, early "
                f"level {_fmt(early)} (mean of the first {ENTROPY_EARLY_STEPS} steps; flagged: above "
                f"{ENTROPY_RATIO:g}x it and above {ENTROPY_FLOOR:g}, {len(stretch)} steps in a row)",
                "The policy is drifting toward random tokens: lower actor.optim.lr, keep actor.entropy_coeff at 0 or "
                "small, tighten actor.clip_ratio_high, or add a KL loss (actor.use_kl_loss=true)"))
    return flags


def health_lines(rows: Sequence[dict], response_length: Optional[int]) -> list[str]:
    """The report's health section: a line per flag, or one line saying none fired; [] for a run without the
    metrics the flags read (an SFT run)."""
    if not any(series(rows, key) for key in (TRUNCATED_KEY, LENGTH_KEY, ENTROPY_KEY)):
        return []
    flags = health_flags(rows, response_length)
    if not flags:
        return ["health: no flags (responses end before the length cap; entropy stays near its early level)"]
    return [part for flag in flags for part in textwrap.wrap(flag.line(), WRAP, subsequent_indent="  ")]


# ----------------------------------------------------------------------------------------------------------------------
# Text


def summary_lines(rows: Sequence[dict], seconds: Optional[float] = None,
                  response_length: Optional[int] = None) -> list[str]:
    """Two or three lines: steps and time per step by phase, reward before -> after, the train reward trend; then a
    line per response-health flag of the run (`health_flags`, response_length: rollout.response_length)."""
    steps = [r for r in rows if r["step"] > 0 and "timing/step_s" in r]
    lines = []
    if steps:
        per_step = fmean(r["timing/step_s"] for r in steps)
        parts = [f"{p} {fmean(r.get(f'timing/{p}_s', 0.0) for r in steps):.3f}" for p in PHASES
                 if any(f"timing/{p}_s" in r for r in steps)]
        took = f" in {seconds:.0f} s" if seconds is not None else ""
        split = f" ({', '.join(parts)})" if parts else ""
        lines.append(f"{len(steps)} steps{took}: {per_step:.3f} s/step{split}")
    val = val_gain(rows)
    train = series(rows, "train/reward_mean")
    trend = []
    if val is not None:
        (s0, v0), (s1, v1) = val["start"], val["end"]
        trend.append(f"{VAL_KEY} {v0:.3f} at step {s0} -> {v1:.3f} at step {s1} ({val['gain']:+.3f})")
    if len(train) > 1:
        tenth = max(1, len(train) // 10)
        first, last = fmean(v for _, v in train[:tenth]), fmean(v for _, v in train[-tenth:])
        trend.append(f"train/reward_mean {first:.3f} -> {last:.3f} (first/last 10% of steps)")
    loss = series(rows, "sft/loss")
    if len(loss) > 1:
        trend.append(f"sft/loss {loss[0][1]:.3f} at step {loss[0][0]} -> {loss[-1][1]:.3f} at step {loss[-1][0]}")
    if trend:
        lines.append("; ".join(trend))
    lines += [flag.line() for flag in health_flags(rows, response_length)]
    return lines


def table_lines(rows: Sequence[dict], columns: int = 6) -> list[str]:
    """One row per metric of TABLE_KEYS present, one column per stretch of steps (the mean over it; validation
    metrics: the last value in it)."""
    steps = sorted({r["step"] for r in rows if r["step"] > 0})
    if not steps:
        return []
    edges = [steps[min(len(steps) - 1, math.ceil(len(steps) * (i + 1) / columns) - 1)] for i in range(columns)]
    edges = sorted(set(edges))
    bounds = list(zip([0] + edges[:-1], edges))
    header = ["steps"] + [f"{lo + 1}-{hi}" if hi > lo + 1 else f"{hi}" for lo, hi in bounds]
    body = []
    for key in TABLE_KEYS:
        points = series(rows, key)
        if not points:
            continue
        cells = [key]
        for lo, hi in bounds:
            inside = [v for s, v in points if lo < s <= hi]
            value = (inside[-1] if key.startswith("val/") else fmean(inside)) if inside else None
            cells.append(_fmt(value))
        body.append(cells)
    return _aligned([header] + body)


# validation metrics shown apart: the reward, the correct final answer, the answer's format
VAL_PARTS = (("val/reward_mean", "reward"), ("val/acc_mean", "acc"), ("val/format_mean", "format"),
             ("val/formatted_mean", "formatted"))
VAL_LEGEND = {"acc": "correct final answer", "format": "a '####' answer present (gsm8k rule)",
              "formatted": "an answer could be read (the reward function's own)"}


def validation_lines(rows: Sequence[dict]) -> list[str]:
    """The first and the last validation's reward, accuracy and format side by side (those of VAL_PARTS the run
    logged); [] without a validation, or with the reward alone (the table shows it)."""
    present = [(key, name) for key, name in VAL_PARTS if series(rows, key)]
    if len(present) < 2:
        return []
    val_rows = [r for r in rows if any(isinstance(r.get(k), (int, float)) for k, _ in present)]
    shown = val_rows[:1] + val_rows[1:][-1:]
    legend = "; ".join(f"{name}: {VAL_LEGEND[name]}" for _, name in present if name in VAL_LEGEND)
    lines = [f"validation ({legend}):"]
    for row in shown:
        cells = "  ".join(f"{name} {row[key]:.3f}" for key, name in present if isinstance(row.get(key), (int, float)))
        lines.append(f"  step {row['step']}: {cells}")
    return lines


SAMPLES_FILE = "samples.jsonl"  # a few train samples of the run's first and latest step (megarl.metrics)
VAL_GENERATIONS_FILE = "val_generations.jsonl"  # the first trainer.log_val_generations prompts of each validation


def read_jsonl(path: str | Path) -> list[dict]:
    """The objects of a jsonl file, [] when it does not exist."""
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def shorten(text: str, limit: int = SHOWN_CHARS) -> str:
    """text itself when at most `limit` characters, else its first and last characters around ' [... N chars ...] '
    (about `limit` in all): the end of a response (its answer, or where it was cut) matters as much as its start."""
    if len(text) <= limit:
        return text
    head = (limit - 20) // 2
    tail = limit - 20 - head
    return f"{text[:head]} [... {len(text) - head - tail} chars ...] {text[-tail:]}"


def wrapped(label: str, text: str, indent: str = "    ", width: int = WRAP) -> list[str]:
    """`label: text` shortened (`shorten`) and wrapped at `width`, keeping the text's own line breaks."""
    lines = []
    for i, para in enumerate(shorten(text).splitlines() or ["(empty)"]):
        first = f"{indent}{label}: " if i == 0 else indent + " " * (len(label) + 2)
        lines += textwrap.wrap(para, width, initial_indent=first, subsequent_indent=indent + " " * (len(label) + 2),
                               replace_whitespace=False) or [first.rstrip()]
    return lines


def pick_samples(scores: Sequence[float], acc: Optional[Sequence[float]] = None) -> list[tuple[int, str]]:
    """Which samples of a batch to show, as (index, label): the first correct and the first wrong one where `acc`
    (per sample: 1 correct, 0 wrong, NaN or None unknown) tells, else the first with the highest and the first with
    the lowest score; one sample when they are all alike. scores: [N] numbers, N >= 1."""
    if acc is not None:
        known = [(i, a) for i, a in enumerate(acc) if a is not None and not math.isnan(a)]
        right = next((i for i, a in known if a >= 1), None)
        wrong = next((i for i, a in known if a <= 0), None)
        if right is not None or wrong is not None:
            return [(i, label) for i, label in ((right, "correct"), (wrong, "wrong")) if i is not None]
    high, low = max(scores), min(scores)
    if high == low:
        return [(0, "all scored alike")]
    return [(list(scores).index(high), "highest score"), (list(scores).index(low), "lowest score")]


def _sample_lines(sample: dict, label: str) -> list[str]:
    facts = [f"score {_fmt(sample.get('score'))}"]
    if sample.get("response_length") is not None:
        facts.append(f"{sample['response_length']} token{'' if sample['response_length'] == 1 else 's'}")
    if sample.get("truncated") is not None:
        facts.append("truncated (hit the length cap)" if sample["truncated"] else "ended")
    if sample.get("ground_truth") is not None:
        facts.append(f"ground truth {shorten(str(sample['ground_truth']), 80)!r}")
    lines = [f"  step {sample['step']}, {label}: {', '.join(facts)}"]
    return lines + wrapped("prompt", str(sample.get("prompt", ""))) + wrapped("response",
                                                                               str(sample.get("response", "")))


def samples_lines(run_dir: str | Path) -> list[str]:
    """Real responses of the run: its first and last step's train samples (SAMPLES_FILE, labelled as the trainer
    picked them), then its first and last validation's generations (VAL_GENERATIONS_FILE: one correct and one wrong
    of each where both exist). [] when the run has neither file."""
    lines = []
    train = read_jsonl(Path(run_dir) / SAMPLES_FILE)
    steps = sorted({s["step"] for s in train})
    if steps:
        shown = steps[:1] + steps[1:][-1:]
        lines.append(f"samples of step {' and step '.join(str(s) for s in shown)} ({SAMPLES_FILE}):")
        for step in shown:
            for sample in (s for s in train if s["step"] == step):
                lines += _sample_lines(sample, sample.get("label", "sample"))
    val = read_jsonl(Path(run_dir) / VAL_GENERATIONS_FILE)
    steps = sorted({s["step"] for s in val})
    if steps:
        shown = steps[:1] + steps[1:][-1:]
        lines.append(f"validation generations of step {' and step '.join(str(s) for s in shown)} "
                     f"({VAL_GENERATIONS_FILE}, the first {len([v for v in val if v['step'] == steps[-1]])} "
                     "prompts of the validation set):")
        for step in shown:
            rows = [v for v in val if v["step"] == step]
            acc = [v.get("acc") for v in rows]
            picks = pick_samples([float(v["score"]) for v in rows], acc if any(a is not None for a in acc) else None)
            for i, label in picks:
                lines += _sample_lines(rows[i], label)
    return lines


def _aligned(rows: Sequence[Sequence[str]]) -> list[str]:
    """Rows of cells as text columns: the first left-aligned, the others right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in rows]


def compare_lines(runs: Sequence[tuple[str, Sequence[dict], Optional[int]]]) -> list[str]:
    """One row per run (name, seed, val/reward_mean at the first and the last validation, best, gain), then the
    range over the runs. `runs`: (name, metrics rows, seed or None)."""
    header = ["run", "seed", "first (step)", "last (step)", "best (step)", "gain"]
    body, gains, ends = [], [], []
    for name, rows, seed in runs:
        g = val_gain(rows)
        if g is None:
            body.append([name, "-" if seed is None else str(seed), "-", "-", "-", "-"])
            continue
        gains.append(g["gain"])
        ends.append(g["end"][1])
        body.append([name, "-" if seed is None else str(seed)]
                    + [f"{g[k][1]:.3f} ({g[k][0]})" for k in ("start", "end", "best")] + [f"{g['gain']:+.3f}"])
    lines = _aligned([header] + body)
    if gains:
        lines.append(f"{VAL_KEY} over {len(gains)} of {len(runs)} runs: gain {min(gains):+.3f} to {max(gains):+.3f} "
                     f"(mean {fmean(gains):+.3f}); last {min(ends):.3f} to {max(ends):.3f}")
    return lines


def gain_problems(runs: Sequence[tuple[str, Sequence[dict], Optional[int]]], min_gain: float) -> list[str]:
    """One line per run whose validation gain is below `min_gain` or that has fewer than two validations."""
    problems = []
    for name, rows, _ in runs:
        g = val_gain(rows)
        if g is None:
            problems.append(f"{name}: fewer than two {VAL_KEY} values (set trainer.test_freq and "
                            f"trainer.val_before_train=true), so it has no gain to check")
        elif g["gain"] < min_gain:
            problems.append(f"{name}: {VAL_KEY} {g['start'][1]:.3f} -> {g['end'][1]:.3f} is a gain of "
                            f"{g['gain']:+.3f}, below --min-gain {min_gain:+.3f}")
    return problems


# ----------------------------------------------------------------------------------------------------------------------
# PNG


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]: steps of 1, 2 or 5 times a power of ten."""
    if hi <= lo:
        pad = abs(lo) * 0.1 or 1.0
        lo, hi = lo - pad, hi + pad
    raw = (hi - lo) / max(1, count - 1)
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    ticks = [math.floor(lo / step) * step]
    while ticks[-1] < hi - step * 1e-9 or len(ticks) < 2:
        ticks.append(round(ticks[-1] + step, 12))
    return ticks


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow without FreeType: the fixed bitmap font
        return ImageFont.load_default()


def _draw_panel(draw, box: tuple[int, int, int, int], title: str, lines: list[tuple[str, list]], fonts) -> None:
    font, small = fonts
    x0, y0, x1, y1 = box
    left, right, top, bottom = x0 + 62, x1 - 14, y0 + 30, y1 - 40
    draw.text((x0 + 10, y0 + 6), title, fill=(0, 0, 0), font=font)
    xs = [s for _, pts in lines for s, _ in pts]
    ys = [v for _, pts in lines for _, v in pts]
    xticks = nice_ticks(min(xs), max(xs), 6)
    yticks = nice_ticks(min(ys), max(ys), 5)
    xlo, xhi, ylo, yhi = xticks[0], xticks[-1], yticks[0], yticks[-1]

    def px(s: float, v: float) -> tuple[float, float]:
        return (left + (s - xlo) / (xhi - xlo or 1) * (right - left),
                bottom - (v - ylo) / (yhi - ylo or 1) * (bottom - top))

    for t in yticks:
        _, y = px(xlo, t)
        draw.line((left, y, right, y), fill=(225, 225, 225))
        label = _fmt(t)
        draw.text((left - 6 - draw.textlength(label, font=small), y - 7), label, fill=(60, 60, 60), font=small)
    for t in xticks:
        x, _ = px(t, ylo)
        draw.line((x, top, x, bottom), fill=(235, 235, 235))
        draw.line((x, bottom, x, bottom + 4), fill=(0, 0, 0))
        label = f"{t:g}"
        draw.text((x - draw.textlength(label, font=small) / 2, bottom + 6), label, fill=(60, 60, 60), font=small)
    draw.rectangle((left, top, right, bottom), outline=(0, 0, 0))
    draw.text(((left + right) / 2 - 14, bottom + 22), "step", fill=(60, 60, 60), font=small)
    legend_x = right - sum(draw.textlength(label, font=small) + 24 for label, _ in lines)
    for i, (label, pts) in enumerate(lines):
        color = COLORS[i % len(COLORS)]
        coords = [px(s, v) for s, v in pts]
        if len(coords) > 1:
            draw.line(coords, fill=color, width=2)
        if len(coords) <= 40:  # sparse series (validation) get markers so single points show
            for x, y in coords:
                draw.ellipse((x - 3, y - 3, x + 3, y + 3), fill=color)
        if len(lines) > 1:
            draw.line((legend_x, y0 + 14, legend_x + 14, y0 + 14), fill=color, width=3)
            draw.text((legend_x + 18, y0 + 7), label, fill=(0, 0, 0), font=small)
            legend_x += draw.textlength(label, font=small) + 24


def write_png(rows: Sequence[dict], path: str | Path, title: str = "") -> Path:
    """Draw every panel that has data, two per row, and save it to `path`."""
    panels = []
    for name, keys in PANELS:
        lines = [(label, series(rows, key)) for key, label in keys]
        lines = [(label, pts) for label, pts in lines if pts]
        if lines:
            panels.append((name, lines))
    if not panels:
        raise ValueError("the metrics have none of the reported keys (train/reward_mean, actor/kl, ...)")
    return _save_panels(panels, path, title)


def write_compare_png(runs: Sequence[tuple[str, Sequence[dict], Optional[int]]], path: str | Path,
                      title: str = "") -> Path:
    """Validation and train reward of several runs, one curve per run in each panel."""
    panels = []
    for key in (VAL_KEY, "train/reward_mean"):
        lines = [(Path(name).name or name, series(rows, key)) for name, rows, _ in runs]
        lines = [(label, pts) for label, pts in lines if pts]
        if lines:
            panels.append((key, lines))
    if not panels:
        raise ValueError(f"none of the runs has {VAL_KEY} or train/reward_mean in its metrics")
    return _save_panels(panels, path, title)


def _save_panels(panels: list[tuple[str, list]], path: str | Path, title: str) -> Path:
    from PIL import Image, ImageDraw

    width, height, head = 600, 300, 40
    rows_n = math.ceil(len(panels) / 2)
    image = Image.new("RGB", (2 * width, head + rows_n * height), "white")
    draw = ImageDraw.Draw(image)
    fonts = (_font(15), _font(12))
    draw.text((12, 10), title, fill=(0, 0, 0), font=_font(17))
    for i, (name, lines) in enumerate(panels):
        x, y = (i % 2) * width, head + (i // 2) * height
        _draw_panel(draw, (x, y, x + width, y + height), name, lines, fonts)
    path = Path(path)
    image.save(path)
    return path


# ----------------------------------------------------------------------------------------------------------------------
# Command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="a run directory (trainer.run_dir) holding metrics.jsonl; several (the seeds of one "
                             "recipe): one row per run and the range of their validation gains")
    parser.add_argument("--out", default=None, help="PNG path; default RUN_DIR/report.png, with several runs "
                                                    "report_runs.png in the folder that holds them")
    parser.add_argument("--columns", type=int, default=6, help="columns (stretches of steps) of the terminal table")
    parser.add_argument("--min-gain", type=float, default=None, metavar="G",
                        help=f"exit 1 when a run's {VAL_KEY} gains less than G from its first validation to its last "
                             "(e.g. 0.15), naming each such run")


def run(args: argparse.Namespace) -> int:
    dirs = [str(d) for d in args.run_dirs]
    try:
        runs = [(d, read_metrics(d), read_seed(d)) for d in dirs]
        if len(runs) == 1:
            rows = runs[0][1]
            path = write_png(rows, args.out or Path(dirs[0]) / "report.png", title=dirs[0])
            lines = table_lines(rows, args.columns)
            lines += health_lines(rows, read_response_length(dirs[0]))
            lines += validation_lines(rows)
            lines += samples_lines(dirs[0])
        else:
            try:
                folder = os.path.commonpath(dirs)
            except ValueError:  # relative and absolute paths mixed
                folder = os.path.commonpath([os.path.abspath(d) for d in dirs])
            default = Path(folder) / "report_runs.png"
            path = write_compare_png(runs, args.out or default, title=f"{len(runs)} runs")
            lines = compare_lines(runs)
    except (FileNotFoundError, ValueError) as exc:
        print(f"megarl report: {exc}", file=sys.stderr)
        return 1
    for line in lines:
        print(line)
    print(f"report: {path}")
    if args.min_gain is not None:
        problems = gain_problems(runs, args.min_gain)
        for problem in problems:
            print(f"megarl report: {problem}", file=sys.stderr)
        if problems:
            return 1
        print(f"every run gained at least {args.min_gain:+.3f}")
    return 0
