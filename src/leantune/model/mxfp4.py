"""MXFP4 (OCP Microscaling, FP4 E2M1 elements, E8M0 scales), as gpt-oss's released expert
weights store it: dequantised on load.

    blocks [..., G, 16] uint8   32 FP4 values per block of the last dim, two per byte: element
                                2j in the low nibble of byte j, element 2j + 1 in the high one
    scales [..., G]     uint8   one power-of-two exponent per block, biased by 127

    value = E2M1(nibble) * 2 ** (scale - 127), E2M1 = sign bit, 2 exponent bits, 1 mantissa bit:
    0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values per scale


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., G, 16] uint8, scales [..., G] uint8 -> values [..., G * 32] of `dtype`."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales "
                         f"{tuple(scales.shape)} (expected blocks [..., G, 16], scales [..., G])")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.int64)
    values = torch.stack([table[b & 0x0F], table[b >> 4]], dim=-1)  # [..., G, 16, 2]
    values = values.flatten(-2)  # [..., G, 32]: low nibble first
    out = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None].float())
    return out.flatten(-2).to(dtype)
