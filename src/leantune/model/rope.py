"""Rotary position embedding tables.

cos/sin are computed once per batch from the per-token `position_ids` (positions restart in every
packed document) and passed to every layer; the rotation itself is `kernels.apply_rope`.
"""

from __future__ import annotations

import math

import torch

from ..errors import LeantuneError


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  device=None, max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim // 2] (fp32) and the attention scaling factor for cos/sin
    (head_dim: the rotated dims; partial rotary passes fewer). LongRoPE: [2, head_dim // 2],
    the short and the long factors' (`rope_cos_sin` picks one per batch)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    if not scaling:
        return inv, 1.0
    rtype = scaling.get("rope_type")
    if rtype == "longrope":
        return _longrope(inv, scaling, max_positions)
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
    if rtype == "yarn":
        return _yarn(inv, head_dim, theta, scaling)
    raise LeantuneError(f"config.json: rope scaling type {rtype!r} is not supported yet "
                        "(supported: default, linear, llama3, yarn, longrope)")


def _longrope(inv: torch.Tensor, scaling: dict,
              max_positions: int | None) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3 / Phi-4, Ding et al. 2024): each frequency divided by its factor, the
    short factors for batches within original_max_position_embeddings, the long ones beyond;
    cos/sin scaled by `attention_factor`, by default sqrt(1 + ln(s) / ln(original)) with
    s = max_position_embeddings / original (or `factor`)."""
    old_ctx = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or (max_positions or old_ctx) / old_ctx
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_ctx))
    n = inv.shape[0]
    factors = torch.tensor([scaling["short_factor"], scaling["long_factor"]],
                           dtype=torch.float32, device=inv.device)
    if factors.shape != (2, n):
        raise LeantuneError(f"config.json: rope short_factor / long_factor must have {n} values "
                            "each (half the rotated head dims)")
    return inv[None] / factors, float(attention)


def longrope_original(scaling: dict | None) -> int | None:
    """Where LongRoPE switches to its long factors (positions >= this), or None."""
    if scaling and scaling.get("rope_type") == "longrope":
        return int(scaling["original_max_position_embeddings"])
    return None


def _yarn(inv: torch.Tensor, head_dim: int, theta: float,
          scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023, "YaRN: Efficient Context Window Extension"): frequencies that
    turn fewer than `beta_slow` times over the original context are interpolated (divided by
    `factor`), those that turn more than `beta_fast` times are kept, with a linear ramp between;
    cos/sin are scaled by 0.1 ln(factor) + 1 (or the mscale ratio, or `attention_factor`).
    `truncate` (default true) rounds the ramp's ends to whole dimensions."""
    factor = float(scaling["factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32.0)
    beta_slow = float(scaling.get("beta_slow") or 1.0)

    def mscale(m: float = 1.0) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(m) / mscale(m_all) if m and m_all else mscale()

    def dim_of(turns: float) -> float:  # the dimension whose frequency turns `turns` times
        return head_dim * math.log(old_ctx / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv.device) - low)
            / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: the original frequency, 0: interpolated
    return inv / factor * (1 - keep) + inv * keep, float(attention)


def rope_cos_sin(position_ids: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                 dtype: torch.dtype, long_from: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of shape [B, T, head_dim] for per-token positions [B, T] (HF half-split layout).
    LongRoPE (inv_freq [2, head_dim // 2], `long_from`): the long frequencies when a position of
    the batch reaches `long_from`, chosen on the device (no host sync), as transformers does."""
    if inv_freq.dim() == 2:
        use_long = position_ids.max() >= long_from
        inv_freq = torch.where(use_long, inv_freq[1], inv_freq[0])
    freqs = position_ids.to(torch.float32)[..., None] * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * attention_scaling).to(dtype), (emb.sin() * attention_scaling).to(dtype)
