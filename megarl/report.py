"""`megarl report RUN_DIR`: the curves of a run from its metrics.jsonl, as a PNG and as a small table in the terminal.

Panels: train/val reward, response length, KL, entropy, grad norm, clip fraction and time per phase over steps.
Drawn with Pillow (no plotting library needed). `summary_lines` gives the end-of-run summary the trainer prints.
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


def read_seed(run_dir: str | Path) -> Optional[int]:
    """trainer.seed from the run's config.resolved.yaml, None where the file or the key is missing."""
    import yaml

    path = Path(run_dir) / "config.resolved.yaml"
    if not path.is_file():
        return None
    try:
        seed = (yaml.safe_load(path.read_text()) or {}).get("trainer", {}).get("seed")
    except (yaml.YAMLError, AttributeError):
        return None
    return seed if isinstance(seed, int) else None


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
# Text


def summary_lines(rows: Sequence[dict], seconds: Optional[float] = None) -> list[str]:
    """Two or three lines: steps and time per step by phase, reward before -> after, the train reward trend."""
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
