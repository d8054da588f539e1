"""Metrics as JSON lines (one object per logged step) and a progress bar with loss, tok/s, ETA."""

from __future__ import annotations

import json
import sys
from pathlib import Path


class MetricsWriter:
    """Appends one JSON object per line to `path`, flushed at once (a crash loses nothing)."""

    def __init__(self, path: str | Path, append: bool = False):
        self.path = Path(path)
        self._f = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class Progress:
    """A tqdm bar over optimizer steps (ETA from tqdm); plain lines when not a terminal."""

    def __init__(self, total: int, initial: int = 0, enabled: bool = True):
        self.bar = None
        self.enabled = enabled
        if enabled:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True,
                            disable=not sys.stderr.isatty())
        self.total = total

    def update(self, step: int, loss: float, tok_s: float, eta_s: float | None = None) -> None:
        if not self.enabled:
            return
        if self.bar is not None and not self.bar.disable:
            self.bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tok_s:,.0f}", refresh=False)
            self.bar.update(1)
        else:
            eta = f", ETA {eta_s:.0f}s" if eta_s is not None else ""
            print(f"step {step}/{self.total}  loss {loss:.4f}  {tok_s:,.0f} tok/s{eta}",
                  file=sys.stderr, flush=True)

    def write(self, msg: str) -> None:
        if self.bar is not None and not self.bar.disable:
            self.bar.write(msg)
        else:
            print(msg, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
