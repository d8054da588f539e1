"""A projection's LoRA term (and its residual) added to the base GEMM's output in one pass.

Where the LoRA term cannot ride inside the base GEMM (an FP8 base: the adapter stays 16-bit; the
o projection, whose input attention writes), the engine used to add it after the GEMM with one
rank-r `addmm_` per projection, and a residual with another pass:

    y = x W^T              (the GEMM)
    y += resid             (read y, resid; write y)
    y += xa B^T            (read y; write y)   one per projection of the group

lora_add_ does both in one pass over y, summed in fp32 with one rounding:

    y <- y + resid + xa B^T     y [n, N], resid [n, N] or None, xa = x A^T [n, R], B [N, R]

B holds the group's s B_i side by side (in the compute dtype: s B rounded once, exact for the
power-of-two scalings alpha / r), each in its own R columns (zeros in the others'), so a
group of projections (q | k | v) is one launch. Per [BLOCK_M, BLOCK_N] tile the kernel loads xa
[BLOCK_M, R] and B^T [R, BLOCK_N] and adds one small tl.dot: two passes' bytes fewer per output
with a residual (read y, resid and write y once), one launch instead of one per projection.
"""

from __future__ import annotations

import torch

from .dispatch import use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None

# The most low-rank columns the kernel takes (a tile holds [BLOCK_M, R] and [R, BLOCK_N]); the
# engine adds larger ranks' terms with addmm_ as before
MAX_RANK = 64
# (BLOCK_M, BLOCK_N, num_warps): an elementwise pass with a small dot; 16-byte accesses
TILE = (64, 128, 4)


def lora_add_reference(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
                       resid: torch.Tensor | None = None) -> torch.Tensor:
    """y <- (y + resid) + xa b^T, summed in fp32 in that order and rounded once (the kernel's
    math; the order of the passes it replaces)."""
    acc = y.float() if resid is None else y.float() + resid.float()
    return y.copy_(torch.addmm(acc, xa.float(), b.float().t()))


if triton is not None:

    @triton.jit
    def _lora_add_kernel(Y, R_, XA, B, rows, cols, R, stride_y, stride_r, stride_xa, stride_b,
                         HAS_RESID: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_R: tl.constexpr, IEEE: tl.constexpr, DOT16: tl.constexpr):
        """Y[tile] <- Y + R_ + XA B^T over one [BLOCK_M, BLOCK_N] tile, fp32."""
        rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rr = tl.arange(0, BLOCK_R)
        mm, mn, mr = rm < rows, rn < cols, rr < R
        mask = mm[:, None] & mn[None, :]
        xa = tl.load(XA + rm[:, None] * stride_xa + rr[None, :], mask=mm[:, None] & mr[None, :],
                     other=0.0)
        bt = tl.load(B + rn[None, :] * stride_b + rr[:, None], mask=mr[:, None] & mn[None, :],
                     other=0.0)
        acc = tl.load(Y + rm[:, None] * stride_y + rn[None, :], mask=mask,
                      other=0.0).to(tl.float32)
        if HAS_RESID:
            acc += tl.load(R_ + rm[:, None] * stride_r + rn[None, :], mask=mask,
                           other=0.0).to(tl.float32)
        # as the GLU kernels' low-rank tiles (kernels/swiglu._lora_tile): fp32 IEEE for fp32
        # inputs, 16-bit operands on the GPU, else TF32 over fp32 casts (16-bit values are exact
        # in TF32; the interpreter multiplies 16-bit operands wrongly)
        if IEEE:
            acc += tl.dot(xa, bt, input_precision="ieee")
        elif DOT16:
            acc += tl.dot(xa, bt)
        else:
            acc += tl.dot(xa.to(tl.float32), bt.to(tl.float32), input_precision="tf32")
        tl.store(Y + rm[:, None] * stride_y + rn[None, :], acc.to(Y.dtype.element_ty), mask=mask)


def _check(y, xa, b, resid) -> None:
    n, cols = y.shape if y.dim() == 2 else (None, None)
    R = xa.shape[-1]
    ok = (y.dim() == 2 and xa.shape == (n, R) and b.shape == (cols, R)
          and (cols <= 1 or y.stride(1) == 1) and (R <= 1 or xa.stride(1) == 1)
          and (R <= 1 or b.stride(1) == 1) and xa.dtype == b.dtype == y.dtype
          and (resid is None or (resid.shape == y.shape and resid.dtype == y.dtype
                                 and (cols <= 1 or resid.stride(1) == 1))))
    if not ok:
        raise ValueError(f"lora_add_: expected y [n, N] with xa [n, R], b [N, R] (and resid "
                         f"[n, N]) of y's dtype with contiguous columns, got y "
                         f"{tuple(y.shape)} {y.dtype}, xa {tuple(xa.shape)} {xa.dtype}, b "
                         f"{tuple(b.shape)} {b.dtype}, resid "
                         f"{None if resid is None else tuple(resid.shape)}")


def lora_add_(y: torch.Tensor, xa: torch.Tensor, b: torch.Tensor,
              resid: torch.Tensor | None = None) -> torch.Tensor:
    """y <- y + resid + xa b^T IN PLACE and return y (module docstring).

    y [n, N] (rows may be strided, e.g. a column slice; columns contiguous), xa [n, R] (R <=
    MAX_RANK), b [N, R] (the scalings folded in), resid [n, N] or None; all of y's dtype. Summed
    in fp32, rounded once."""
    _check(y, xa, b, resid)
    if xa.shape[1] > MAX_RANK:
        raise ValueError(f"lora_add_: at most {MAX_RANK} low-rank columns, got {xa.shape[1]}")
    if not use_triton(y):
        return lora_add_reference(y, xa, b, resid)
    n, cols = y.shape
    if n == 0 or cols == 0:
        return y
    bm, bn, warps = TILE
    R = xa.shape[1]
    r = y if resid is None else resid
    _lora_add_kernel[(triton.cdiv(n, bm), triton.cdiv(cols, bn))](
        y, r, xa, b, n, cols, R, y.stride(0), r.stride(0), xa.stride(0), b.stride(0),
        HAS_RESID=resid is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_R=max(16, triton.next_power_of_2(R)), IEEE=y.dtype == torch.float32,
        DOT16=y.is_cuda, num_warps=warps)
    return y


__all__ = ["MAX_RANK", "TILE", "lora_add_", "lora_add_reference"]
