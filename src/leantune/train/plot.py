"""The loss plot of a run: train loss, eval loss and the learning rate, from metrics.jsonl.
A preference run (DPO, ORPO, SimPO) gets a second panel below: the reward margin and the reward
accuracy (train, and eval where there is one).

`leantune plot RUN` writes RUN/loss.png; the end of `Trainer.train` writes it too when matplotlib
is installed (an optional dependency: ``pip install 'leantune[plot]'``). Drawn on a bare
`matplotlib.figure.Figure` (the Agg renderer), so no display and no pyplot state are involved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import LeantuneError
from ..utils.io import atomic_path

PLOT_NAME = "loss.png"
INSTALL = "pip install 'leantune[plot]'"


def read_metrics(path: Path) -> list[dict]:
    """The records of a metrics.jsonl file. A last line without its newline is a record being
    written (the run is still going) and is left out; any other bad line is an error."""
    try:
        lines = path.read_text().split("\n")
    except OSError as e:
        raise LeantuneError(f"{path}: cannot read ({e.strerror or e})") from None
    records = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if lineno == len(lines):
                continue
            raise LeantuneError(f"{path}:{lineno}: malformed JSON; metrics.jsonl holds one JSON "
                                "record per line, as `leantune train` writes it") from None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise LeantuneError(f"{path}:{lineno}: expected a record with an integer \"step\", "
                                "as `leantune train` writes it")
        records.append(record)
    return records


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], float(r[key])) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [s for s, _ in points], [v for _, v in points]


def plot_metrics(run: str | os.PathLike, output: str | os.PathLike | None = None) -> Path:
    """Draw RUN/metrics.jsonl (or a metrics file given directly) into a PNG.

    Args:
        run: the output folder of a run, or its metrics.jsonl.
        output: the PNG to write; default loss.png next to metrics.jsonl.
    Returns:
        the PNG's path.
    Raises:
        LeantuneError: no run or metrics there, no loss records yet, matplotlib missing.
    """
    run = Path(run)
    metrics = run / "metrics.jsonl" if run.is_dir() else run
    if not metrics.is_file():
        raise LeantuneError(f"{metrics}: not found; give the --output folder of a `leantune "
                            "train` run (it writes metrics.jsonl from the first logged step)")
    records = read_metrics(metrics)
    train, evals, lrs = (_series(records, k) for k in ("loss", "eval_loss", "lr"))
    if not train[0] and not evals[0]:
        raise LeantuneError(f"{metrics}: no loss recorded yet; plot again after the first logged "
                            "step")
    out = Path(output) if output is not None else metrics.with_name(PLOT_NAME)
    if not out.parent.is_dir():
        raise LeantuneError(f"{out.parent}: folder does not exist; create it or choose another "
                            "--output")
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise LeantuneError(f"plotting needs matplotlib; run `{INSTALL}`") from None

    prefs = {k: _series(records, k) for k in ("reward_margin", "eval_reward_margin",
                                               "reward_accuracy", "eval_reward_accuracy")}
    rewards = any(v[0] for v in prefs.values())
    fig = Figure(figsize=(8, 7.5 if rewards else 4.5), layout="constrained")
    ax = fig.add_subplot(2, 1, 1) if rewards else fig.add_subplot()
    lines = []
    if train[0]:
        lines += ax.plot(*train, color="C0", linewidth=1.2, label="train loss")
    if evals[0]:
        lines += ax.plot(*evals, "o-", color="C1", markersize=4, label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    if lrs[0]:
        lr_ax = ax.twinx()
        lines += lr_ax.plot(*lrs, "--", color="C2", linewidth=1, alpha=0.8, label="learning rate")
        lr_ax.set_ylabel("learning rate")
        lr_ax.set_ylim(bottom=0)
        lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
        ax.set_zorder(lr_ax.get_zorder() + 1)  # the losses and the legend above the lr line
        ax.patch.set_visible(False)
    ax.legend(handles=lines, loc="best")
    ax.set_title(metrics.parent.resolve().name)
    if rewards:
        _reward_panel(fig.add_subplot(2, 1, 2, sharex=ax), prefs)
    with atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120)
    return out


def _reward_panel(ax, prefs: dict) -> None:
    """The preference metrics: reward margin (left axis) and reward accuracy (right, 0..1)."""
    lines = []
    styles = {"reward_margin": ("-", "C3", "reward margin"),
              "eval_reward_margin": ("o-", "C5", "eval reward margin"),
              "reward_accuracy": ("-", "C4", "reward accuracy"),
              "eval_reward_accuracy": ("o-", "C6", "eval reward accuracy")}
    acc_ax = ax.twinx()
    for key, (style, color, label) in styles.items():
        steps, values = prefs[key]
        if steps:
            target = acc_ax if "accuracy" in key else ax
            lines += target.plot(steps, values, style, color=color, linewidth=1.2,
                                 markersize=4, label=label)
    ax.axhline(0, color="grey", linewidth=0.6, alpha=0.6)
    ax.set_xlabel("step")
    ax.set_ylabel("reward margin")
    ax.grid(alpha=0.3)
    acc_ax.set_ylabel("reward accuracy")
    acc_ax.set_ylim(-0.02, 1.02)
    ax.legend(handles=lines, loc="best")


def plot_outdated(output: Path) -> bool:
    """Whether the end of a run would draw OUTPUT/loss.png now: matplotlib is there and the plot
    is missing or older than metrics.jsonl (a run stopped before its plot was drawn)."""
    from importlib.util import find_spec

    output = Path(output)
    metrics, plot = output / "metrics.jsonl", output / PLOT_NAME
    if find_spec("matplotlib") is None or not metrics.is_file():
        return False
    return not plot.is_file() or plot.stat().st_mtime < metrics.stat().st_mtime


def plot_after_training(output: Path, log) -> Path | None:
    """Write OUTPUT/loss.png when matplotlib is there; otherwise say once how to get it. The plot
    is a convenience: whatever goes wrong with it is a note, never the failure of a finished
    run."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        log(f"note: no {PLOT_NAME} (it needs matplotlib: {INSTALL})")
        return None
    try:
        path = plot_metrics(output)
    except LeantuneError as e:
        log(f"note: no {PLOT_NAME} ({e})")
        return None
    except Exception as e:  # matplotlib's own failures (fonts, backends, a full disk)
        log(f"note: no {PLOT_NAME} ({type(e).__name__}: {' '.join(str(e).split())[:200]}); "
            f"`leantune plot {output}` draws it later")
        return None
    log(f"loss plot: {path}")
    return path
