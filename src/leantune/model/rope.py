"""Rotary position embedding tables.

cos/sin are computed once per batch from the per-token `position_ids` (positions restart in every
packed document) and passed to every layer; the rotation itself is `kernels.apply_rope`.
"""

from __future__ import annotations

import math

import torch

from ..errors import LeantuneError


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32) and the attention scaling factor for cos/sin."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if not scaling:
        return inv, 1.0
    rtype = scaling.get("rope_type")
    if rtype == "linear":
        return inv / float(scaling["factor"]), 1.0
    if rtype == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    raise LeantuneError(f"config.json: rope scaling type {rtype!r} is not supported yet "
                        "(supported: default, linear, llama3)")


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, head_dim] for per-token positions [B, T] (HF half-split layout)."""
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)
