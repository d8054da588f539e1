"""Metrics as JSON lines (one object per logged step) and a progress bar with loss, tok/s, ETA."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per line to `path`, flushed at once (a crash loses nothing).
    A symbolic link at `path` is refused in one line, never written through. A NaN or
    infinite value is written as null (strict JSON readers such as jq refuse NaN)."""

    def __init__(self, path: str | Path, append: bool = False):
        from ..utils.io import open_append

        self.path = Path(path)
        self._f = open_append(self.path, truncate=not append)

    def write(self, record: dict) -> None:
        record = {k: None if isinstance(v, float) and not math.isfinite(v) else v
                  for k, v in record.items()}
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class NoMetrics:
    """The metrics writer of a process that writes nothing (under torchrun, all but rank 0)."""

    def write(self, record: dict) -> None:
        pass

    def close(self) -> None:
        pass


class Progress:
    """Where a run reports its steps: a tqdm bar (ETA from tqdm) when stdout is a terminal and
    `bar` is on, else one plain line per logged step. Everything goes to stdout, like the rest of
    a run's log and summary, so `leantune train ... > log` keeps the whole run (errors go to
    stderr: add `2>&1` for them). `quiet`: nothing at all (under torchrun, all but rank 0)."""

    def __init__(self, total: int, initial: int = 0, bar: bool = True, quiet: bool = False):
        self.bar = None
        self.quiet = quiet
        if bar and not quiet and sys.stdout.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            file=sys.stdout)
        self.total = total

    def update(self, step: int, loss: float, tok_s: float, eta_s: float | None = None,
               metrics: dict[str, float] | None = None) -> None:
        """`metrics`: the objective's other logged values (name -> value), after the loss."""
        if self.quiet:
            return
        metrics = metrics or {}
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", **{k: f"{v:.4f}" for k, v in metrics.items()},
                                 tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(step - self.bar.n)
        else:
            eta = f", ETA {eta_s:.0f}s" if eta_s is not None else ""
            extra = "".join(f"  {k} {v:.4f}" for k, v in metrics.items())
            print(f"step {step}/{self.total}  loss {loss:.4f}{extra}  {tok_s:,.0f} tok/s{eta}",
                  flush=True)

    def write(self, msg: str) -> None:
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.write(msg, file=sys.stdout)
        else:
            print(msg, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
