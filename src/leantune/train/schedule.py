"""Learning-rate schedule: linear warm-up, then cosine or linear decay to 0 (or constant)."""

from __future__ import annotations

import math


def lr_factor(step: int, warmup: int, total: int, kind: str = "cosine") -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based) of `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    progress = min(max(progress, 0.0), 1.0)
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
