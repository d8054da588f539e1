"""Small tensor helpers shared by the model and the engine."""

from __future__ import annotations

import torch


def rowdot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Dot products of the rows of a, b [..., n] (same shape) -> [...] fp32, as one batched
    matmul (fp32 accumulation, each result rounded once to the inputs' dtype): no [..., n]
    fp32 temporaries."""
    lead = a.shape[:-1]
    n = a.shape[-1]
    return torch.bmm(a.reshape(-1, 1, n), b.reshape(-1, n, 1)).view(lead).float()
