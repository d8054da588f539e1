"""Training metrics to TensorBoard and Weights & Biases (`--report-to`).

The trainer writes one record per logged step to metrics.jsonl (`MetricsWriter`); `open_reporting`
gives it a writer that also sends every record to the chosen reporters. A record is a flat dict: a
"step" and numbers, e.g. ``{"step", "loss", "lr", "grad_norm", "tokens_per_s", ...}`` for a
training step and ``{"step", "eval_loss"}`` for an evaluation. Reporters log each number as
``train/<key>``, except ``eval_loss``, which is ``eval/loss``.

Both backends are optional dependencies, imported only when a run asks for them;
`check_report_to` runs before the model is loaded, so a missing one fails in one line at once.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

from ..errors import LeantuneError
from ..utils.io import refuse_links
from .metrics import MetricsWriter

REPORTERS = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"


def parse_report_to(value: str | list | None) -> list[str]:
    """``none`` (or nothing) -> []; ``tensorboard,wandb`` (or a YAML list of both) -> both."""
    items = value if isinstance(value, (list, tuple)) else str(value or "").split(",")
    names = list(dict.fromkeys(str(n).strip().lower() for n in items if str(n).strip()))
    if names in ([], ["none"]):
        return []
    for name in names:
        if name == "none":
            raise LeantuneError(f"--report-to {','.join(names)}: 'none' cannot be combined with reporters; "
                                "give none alone, or only reporters")
        if name not in REPORTERS:
            raise LeantuneError(f"--report-to: unknown reporter {name!r}; use none, tensorboard, "
                                "wandb, or a comma list such as tensorboard,wandb")
    return names


def _import(name: str):
    """The reporter's library: torch's TensorBoard SummaryWriter class, or the wandb module."""
    try:
        if name == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            return SummaryWriter
        import wandb

        return wandb
    except ImportError:
        raise LeantuneError(f"--report-to {name} needs the {name} package; run `pip install "
                            f"'leantune[{name}]'`, or drop {name} from --report-to") from None


def check_report_to(value: str | None) -> None:
    """Valid names, and their packages installed (cheap: before the model is loaded)."""
    for name in parse_report_to(value):
        _import(name)


def _scalars(record: dict) -> dict[str, float]:
    out = {}
    for key, value in record.items():
        if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        out["eval/loss" if key == "eval_loss" else f"train/{key}"] = float(value)
    return out


class TensorBoardReporter:
    """Event files in OUTPUT/tensorboard: ``tensorboard --logdir OUTPUT``.

    Events that an earlier run in the same folder wrote at or after `start_step` (a replaced run,
    or the steps an interrupted run redoes on --resume) are hidden by TensorBoard's purge step,
    not deleted."""

    def __init__(self, output: Path, start_step: int):
        summary_writer = _import("tensorboard")
        refuse_links(output / TENSORBOARD_DIR, output)  # its event files go there
        self.writer = summary_writer(str(output / TENSORBOARD_DIR), purge_step=start_step)

    def log(self, record: dict) -> None:
        for tag, value in _scalars(record).items():
            self.writer.add_scalar(tag, value, record["step"])
        self.writer.flush()  # a crash loses nothing, as with metrics.jsonl

    def close(self) -> None:
        self.writer.close()


class WandbReporter:
    """A Weights & Biases run named after the output folder, in the project $WANDB_PROJECT
    (default "leantune"), with the run's settings as its config. Its local files go to
    OUTPUT/wandb. WANDB_MODE=offline logs without the network (`wandb sync` uploads later)."""

    def __init__(self, output: Path, config: dict):
        wandb = _import("wandb")
        refuse_links(output / "wandb", output)  # wandb's local files go there
        try:
            self.run = wandb.init(project=os.environ.get("WANDB_PROJECT") or "leantune",
                                  name=output.resolve().name, dir=str(output), config=config)
        except Exception as e:  # not logged in, no network, bad settings: wandb's own types
            raise LeantuneError(
                f"--report-to wandb: wandb.init failed ({type(e).__name__}: "
                f"{' '.join(str(e).split())[:200]}); run `wandb login`, or set WANDB_MODE=offline "
                "to log locally") from None

    def log(self, record: dict) -> None:
        self.run.log(_scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class Reporting:
    """metrics.jsonl and the reporters behind the writer interface the trainer uses."""

    def __init__(self, writer, reporters: list):
        self.writer = writer
        self.reporters = reporters

    def write(self, record: dict) -> None:
        self.writer.write(record)
        for reporter in self.reporters:
            reporter.log(record)

    def close(self) -> None:
        self.writer.close()
        for reporter in self.reporters:
            reporter.close()


def open_reporting(cfg, start_step: int) -> Reporting:
    """OUTPUT/metrics.jsonl (appended to on --resume) and the reporters `cfg.report_to` names.

    The reporters start first: when one fails (wandb.init), no metrics.jsonl marks the output
    folder as holding a run."""
    output = Path(cfg.output)
    reporters = []
    for name in parse_report_to(cfg.report_to):
        if name == "tensorboard":
            reporters.append(TensorBoardReporter(output, start_step))
        else:
            config = {k: v for k, v in asdict(cfg).items() if k != "extra"}
            reporters.append(WandbReporter(output, config))
    return Reporting(MetricsWriter(output / "metrics.jsonl", append=cfg.resume), reporters)
