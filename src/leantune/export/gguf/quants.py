"""Block quantisers for GGUF tensors: float weights -> the raw bytes of GGML's block layouts.

Each quantiser maps blocks of a float tensor ([n_blocks, block] fp32) to their bytes
([n_blocks, block_bytes] uint8), vectorised over all blocks at once (torch). The layouts are
GGML's published ones (gguf-py's dequantisers are the reference in the tests); every 16-bit
scale is stored as IEEE half, little-endian.

- q8_0, blocks of 32: d (f16), 32 x int8 q; value d * q.
- q4_0, 32: d, 16 bytes (byte j: q[j] low nibble, q[j + 16] high); value d * (q - 8).
- q5_0, 32: d, the 32 fifth bits (uint32), 16 bytes of low nibbles as q4_0; d * (q - 16).
- q4_k, 256 (8 sub-blocks of 32): d, dmin, 12 bytes of eight 6-bit (scale, min) pairs, 128
  bytes of nibbles; value d * sc[j] * q - dmin * m[j] in sub-block j.
- q6_k, 256 (16 sub-blocks of 16): 128 bytes of low nibbles, 64 bytes of high 2-bit pairs,
  16 x int8 scales, d; value d * sc[j] * (q - 32).

The K-quant scales are chosen by a small search: q4_k tries a few step sizes per sub-block and
refits scale and offset by least squares on the resulting codes; q6_k does the same for its
symmetric scale. Both then quantise the sub-block scales against the super-block's d (and dmin).

Speed (8B shape, tensors streamed one at a time, this project's 2-core CPU): see
`python -m leantune.export.gguf.bench` (its docstring records the measured numbers).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

# Elements per chunk of blocks quantised at once: large enough to amortise torch's per-op
# overhead, small enough that the temporaries of the K-quant search stay in cache-sized buffers.
CHUNK_ELEMENTS = 1 << 18


@dataclass(frozen=True)
class QuantType:
    """One GGML tensor type: its GGUF id, block size (elements) and bytes per block."""

    name: str
    ggml_type: int
    block: int
    block_bytes: int
    encode: Callable[[torch.Tensor], torch.Tensor] | None  # None: a plain float type

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes

    def fits(self, cols: int) -> bool:
        """Rows of `cols` elements split into whole blocks."""
        return cols % self.block == 0


def _inv(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block quantises to zeros)."""
    return torch.where(d == 0, torch.zeros_like(d), 1.0 / d)


def _half_bytes(d: torch.Tensor) -> torch.Tensor:
    """[n, 1] fp32/fp16 -> [n, 2] uint8: the IEEE half, little-endian."""
    return d.to(torch.float16).contiguous().view(torch.uint8)


def _signed_absmax(x: torch.Tensor) -> torch.Tensor:
    """The element of largest magnitude along the last dim, with its sign ([..., 1])."""
    return x.gather(-1, x.abs().argmax(-1, keepdim=True))


def _dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b) over the last dim, in one pass."""
    return torch.linalg.vecdot(a, b)


def _nibbles(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    return (lo & 15) | ((hi & 15) << 4)


def _q8_0(x: torch.Tensor) -> torch.Tensor:
    d = (x.abs().amax(-1, keepdim=True) / 127).half()
    q = (x * _inv(d.float())).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([_half_bytes(d), q.view(torch.uint8)], -1)


def _symmetric_codes(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale d (half) mapping the largest-magnitude element onto code -levels, and the codes
    q + levels in [0, 2 * levels - 1] (uint8): q4_0 (levels 8) and q5_0 (levels 16)."""
    d = (_signed_absmax(x) / -levels).half()
    q = (x * _inv(d.float())).round().add(levels).clamp(0, 2 * levels - 1).to(torch.uint8)
    return d, q


def _q4_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric_codes(x, 8)
    return torch.cat([_half_bytes(d), _nibbles(q[:, :16], q[:, 16:])], -1)


_BIT_WEIGHTS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """[n, 8k] of 0/1 -> [n, k] bytes, bit b of byte j = element 8j + b (little-endian order)."""
    n = bits.shape[0]
    return (bits.view(n, -1, 8) * _BIT_WEIGHTS).sum(-1, dtype=torch.int32).to(torch.uint8)


def _q5_0(x: torch.Tensor) -> torch.Tensor:
    d, q = _symmetric_codes(x, 16)
    return torch.cat([_half_bytes(d), _pack_bits(q >> 4), _nibbles(q[:, :16], q[:, 16:])], -1)


# Step sizes tried per q4_k sub-block, as the number of codes spanning [min(x, 0), max(x)]:
# 15 is the plain min/max grid; wider grids clip the extremes and give the bulk finer steps.
# On Gaussian / Laplace / Student-t(4) weights these nine give 16-25% lower RMS error than q4_0
# (a grid of 13 from 13 to 20 gains another 0.3%).
Q4_K_GRID = (14.0, 14.5, 15.0, 15.5, 16.0, 16.5, 17.0, 18.0, 19.0)


def _fit_affine(x: torch.Tensor, top: int, grid) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of x [..., k]: (scale >= 0, offset >= 0) so x ~ scale * q - offset, q in [0, top].

    For each grid entry the codes come from the min/max grid; scale and offset are then refitted
    by least squares on those codes (offset forced to 0 where it would be negative) and the fit of
    lowest squared error is kept."""
    k = x.shape[-1]
    lo = x.amin(-1).clamp(max=0)
    span = x.amax(-1) - lo
    above = x - lo[..., None]
    sx, sxx = x.sum(-1), _dot(x, x)
    best_err = torch.full_like(sx, float("inf"))
    best_s, best_b = torch.zeros_like(sx), torch.zeros_like(sx)
    for levels in grid:
        q = (above * _inv(span / levels)[..., None]).round_().clamp_(0, top)
        sq, sqq, sqx = q.sum(-1), _dot(q, q), _dot(q, x)
        det = k * sqq - sq * sq
        s = (k * sqx - sq * sx) * _inv(det)
        b = (sx - s * sq) / k  # x ~ s * q + b
        through_zero = b > 0  # an offset must be <= 0 here: fit the scale alone
        s = torch.where(through_zero, sqx * _inv(sqq), s).clamp_(min=0)
        b = torch.where(through_zero, torch.zeros_like(b), b)
        err = s * s * sqq + 2 * s * b * sq + k * b * b - 2 * s * sqx - 2 * b * sx + sxx
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
        best_b = torch.where(better, b, best_b)
    return best_s, -best_b


def _pack_k_scales(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins [n, 8] (uint8) -> q4_k's 12 bytes: bytes 0-3 hold sc[0:4]
    with the top 2 bits of sc[4:8] above them, bytes 4-7 the same for the mins, bytes 8-11 the
    low nibbles of sc[4:8] (low) and mn[4:8] (high)."""
    return torch.cat([sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
                      mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                      _nibbles(sc[:, 4:], mn[:, 4:])], -1)


def _q4_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.view(n, 8, 32)
    scale, offset = _fit_affine(sub, 15, Q4_K_GRID)  # [n, 8]
    d = (scale.amax(-1, keepdim=True) / 63).half()
    dmin = (offset.amax(-1, keepdim=True) / 63).half()
    sc = (scale * _inv(d.float())).round().clamp(0, 63)
    mn = (offset * _inv(dmin.float())).round().clamp(0, 63)
    step, off = d.float() * sc, dmin.float() * mn
    q = ((sub + off[..., None]) * _inv(step)[..., None]).round_().clamp_(0, 15).to(torch.uint8)
    qs = _nibbles(q[:, 0::2], q[:, 1::2]).reshape(n, 128)
    return torch.cat([_half_bytes(d), _half_bytes(dmin),
                      _pack_k_scales(sc.to(torch.uint8), mn.to(torch.uint8)), qs], -1)


# Scale multipliers tried per q6_k sub-block around the largest-magnitude one (that element on
# code -32); each candidate is refitted by least squares on its codes.
Q6_K_GRID = (1.0, 0.97, 1.03, 0.94)


def _fit_symmetric(x: torch.Tensor, grid) -> torch.Tensor:
    """Per row of x [..., k]: a signed scale s so x ~ s * q, q in [-32, 31]."""
    s0 = _signed_absmax(x)[..., 0] / -32
    best_err = torch.full_like(s0, float("inf"))
    best_s = torch.zeros_like(s0)
    for f in grid:
        q = (x * _inv(s0 * f)[..., None]).round_().clamp_(-32, 31)
        sqq, sqx = _dot(q, q), _dot(q, x)
        s = sqx * _inv(sqq)
        err = -s * sqx  # the least-squares residual for this s, less sum(x^2)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_s = torch.where(better, s, best_s)
    return best_s


def _q6_k(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    sub = x.view(n, 16, 16)
    s = _fit_symmetric(sub, Q6_K_GRID)  # [n, 16]
    d = (_signed_absmax(s) / -128).half()
    sc = (s * _inv(d.float())).round().clamp(-128, 127)
    step = d.float() * sc
    q = (sub * _inv(step)[..., None]).round_().clamp_(-32, 31).add_(32).to(torch.uint8)
    q = q.view(n, 2, 4, 32)  # element 128 h + 32 g + i
    low, high = q & 15, q >> 4
    ql = _nibbles(low[:, :, 0:2], low[:, :, 2:4]).reshape(n, 128)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4)
          | (high[:, :, 3] << 6)).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), _half_bytes(d)], -1)


QUANT_TYPES: dict[str, QuantType] = {q.name: q for q in [
    QuantType("f32", 0, 1, 4, None),
    QuantType("f16", 1, 1, 2, None),
    QuantType("bf16", 30, 1, 2, None),
    QuantType("q8_0", 8, 32, 34, _q8_0),
    QuantType("q4_0", 2, 32, 18, _q4_0),
    QuantType("q5_0", 6, 32, 22, _q5_0),
    QuantType("q4_k", 12, 256, 144, _q4_k),
    QuantType("q6_k", 14, 256, 210, _q6_k),
]}

_FLOATS = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


@torch.no_grad()
def quantize(t: torch.Tensor, qtype: QuantType) -> np.ndarray:
    """A float tensor [..., cols] -> its GGUF bytes, uint8 [..., qtype.row_bytes(cols)].

    cols must be a multiple of qtype.block (see QuantType.fits)."""
    cols = t.shape[-1]
    lead = tuple(t.shape[:-1])
    if qtype.encode is None:
        raw = t.to(_FLOATS[qtype.name]).contiguous().view(torch.uint8)
        return raw.reshape(*lead, qtype.row_bytes(cols)).numpy()
    if not qtype.fits(cols):
        raise ValueError(f"rows of {cols} do not split into {qtype.name} blocks of {qtype.block}")
    blocks = t.reshape(-1, qtype.block)
    out = torch.empty(blocks.shape[0], qtype.block_bytes, dtype=torch.uint8)
    step = max(1, CHUNK_ELEMENTS // qtype.block)
    for i in range(0, blocks.shape[0], step):
        out[i:i + step] = qtype.encode(blocks[i:i + step].float())
    return out.reshape(*lead, qtype.row_bytes(cols)).numpy()
