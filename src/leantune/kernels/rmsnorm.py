"""RMSNorm: y = x / sqrt(mean(x^2) + eps) * (offset + w).

offset is 0 for Llama/Qwen/Mistral and 1 for Gemma's (1 + w) variant. Statistics in fp32.

The fused version is one Triton kernel each way:
  forward   reads x once, writes y and rstd (one fp32 per row, saved for backward);
  backward  reads x, dy, rstd and writes dx; the weight gradient is only computed when the weight
            requires grad (LoRA/QLoRA freeze the norms: then no dW work is done at all). dW is
            reduced in two stages: a persistent grid of 8 programs per SM each sums its rows in
            fp32 registers into one partial row, then torch sums the [programs, H] partials.
Small rows (q/k norm over head_dim) are processed several per program as a 2-D tile, so a
program always has a few thousand elements to work on.

rms_norm_fwd can also write y's e4m3 codes and 1 x 128 block scales (`quant`: the buffers of a
kernels/fp8_quant.QuantizedRows, for the cuBLAS FP8 GEMM that reads y next), quantised in the
same program from the rounded y it stores: equal to quantize_rows(y) bit for bit, without that
pass over y.
"""

from __future__ import annotations

import torch

from .dispatch import num_warps_for, sm_count, use_triton

try:
    import triton
    import triton.language as tl

    from .fp8_quant import quantize_block
except ImportError:  # the package works without Triton (reference path only)
    triton = None

QBLOCK = 128  # the activation blocks of the fused quantised output (kernels/fp8.BLOCK)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float,
                       offset: float = 0.0) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H] in x.dtype (HF's order of casts)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    w = weight.float() + offset if offset else weight
    if offset:
        return (xf * w).to(x.dtype)
    return w * xf.to(x.dtype)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _rms_norm_fwd_kernel(X, W, Y, RSTD, Q, ST, n_rows, H, stride_x, stride_y, stride_s,
                             eps, offset, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                             HAS_OFFSET: tl.constexpr, QUANT: tl.constexpr,
                             ROUND_FP32: tl.constexpr):
        """One program normalises BLOCK_R rows of BLOCK_H (>= H) columns. QUANT: also y's e4m3
        codes into Q [n_rows, H] (uint8, contiguous) and its 1 x 128 block scales into ST
        [H / 128, n_rows] (row stride stride_s), from y as stored (BLOCK_H a multiple of
        128)."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.arange(0, BLOCK_H)
        rmask = rows < n_rows
        cmask = cols < H
        mask = rmask[:, None] & cmask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        xf = x.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / H + eps)
        tl.store(RSTD + rows, rstd, mask=rmask)
        xn = xf * rstd[:, None]
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            y = xn * (w + offset)[None, :]  # Gemma: (x_f32 * rstd * (1 + w_f32)).to(x.dtype)
        else:
            # Llama: w * (x_f32 * rstd).to(x.dtype) -- round the normalised x first, as HF does.
            y = xn.to(x.dtype).to(tl.float32) * w[None, :]
        y = y.to(Y.dtype.element_ty)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], y, mask=mask)
        if QUANT:
            NB: tl.constexpr = BLOCK_H // 128  # (128: QBLOCK)
            q, sc = quantize_block(tl.reshape(y.to(tl.float32), (BLOCK_R, NB, 128)), 2,
                                   ROUND_FP32)
            kb = tl.arange(0, NB)
            c3 = kb[None, :, None] * 128 + tl.arange(0, 128)[None, None, :]
            tl.store(Q + rows[:, None, None] * H + c3, q, mask=rmask[:, None, None] & (c3 < H))
            tl.store(ST + kb[None, :] * stride_s + rows[:, None], sc,
                     mask=rmask[:, None] & (kb * 128 < H)[None, :])

    @triton.jit
    def _rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW_PART, RES, n_rows, H, stride_dy, stride_x,
                             stride_dx, stride_res, offset,
                             BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                             HAS_OFFSET: tl.constexpr, COMPUTE_DX: tl.constexpr,
                             COMPUTE_DW: tl.constexpr, HAS_RES: tl.constexpr):
        """Grid-stride loop over blocks of BLOCK_R rows.

        dx = rstd * (g - xhat * mean(g * xhat)) [+ res],  g = dy * (offset + w),  xhat = x * rstd
        dw = sum over rows of dy * xhat   (xhat rounded to x.dtype first when offset == 0)
        res: the gradient arriving through a residual connection, added before rounding.
        """
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        cols = tl.arange(0, BLOCK_H)
        cmask = cols < H
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            w = w + offset
        dw_acc = tl.zeros((BLOCK_R, BLOCK_H), dtype=tl.float32)  # reduced over rows at the end
        n_blocks = tl.cdiv(n_rows, BLOCK_R)
        for rb in tl.range(pid, n_blocks, nprog):
            rows = rb * BLOCK_R + tl.arange(0, BLOCK_R).to(tl.int64)  # int64 offsets
            rmask = rows < n_rows
            mask = rmask[:, None] & cmask[None, :]
            x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
            dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask,
                         other=0.0).to(tl.float32)
            rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
            xhat = x.to(tl.float32) * rstd[:, None]
            if COMPUTE_DW:
                if HAS_OFFSET:
                    dw_acc += dy * xhat
                else:
                    dw_acc += dy * xhat.to(x.dtype).to(tl.float32)
            if COMPUTE_DX:
                g = dy * w[None, :]
                c = tl.sum(g * xhat, axis=1) / H
                dx = (g - xhat * c[:, None]) * rstd[:, None]
                if HAS_RES:
                    dx += tl.load(RES + rows[:, None] * stride_res + cols[None, :], mask=mask,
                                  other=0.0).to(tl.float32)
                tl.store(DX + rows[:, None] * stride_dx + cols[None, :],
                         dx.to(DX.dtype.element_ty), mask=mask)
        if COMPUTE_DW:
            tl.store(DW_PART + pid.to(tl.int64) * H + cols, tl.sum(dw_acc, axis=0), mask=cmask)


_DW_PROGRAMS_PER_SM = 8  # persistent grid size for the dW reduction (best of 4..64 on an H200)


def _tile(H: int) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_H, num_warps): a whole row per tile, rows stacked up to ~4K elements."""
    block_h = triton.next_power_of_2(H)
    block_r = max(1, min(64, 4096 // block_h))
    return block_r, block_h, num_warps_for(block_r * block_h)


def _launch_fwd(x2, w, y2, rstd, eps: float, offset: float, quant=None) -> None:
    """x2, y2: [n, H] (rows contiguous), rstd: [n] fp32 (written); quant: (codes e4m3 [n, H]
    contiguous, scale_t fp32 [ceil(H / 128), n] with unit column stride) to write too."""
    n, H = x2.shape
    if n:
        block_r, block_h, warps = _tile(H)
        if quant is not None and block_h < QBLOCK:  # (whole quantisation blocks a tile)
            block_h = QBLOCK
        codes, scale_t = quant if quant is not None else (rstd, rstd)
        _rms_norm_fwd_kernel[(triton.cdiv(n, block_r),)](
            x2, w, y2, rstd, codes.view(torch.uint8) if quant is not None else codes, scale_t,
            n, H, x2.stride(0), y2.stride(0), scale_t.stride(0) if quant is not None else 0,
            eps, float(offset), BLOCK_R=block_r, BLOCK_H=block_h, HAS_OFFSET=bool(offset),
            QUANT=quant is not None, ROUND_FP32=not x2.is_cuda, num_warps=warps)


class _RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        H = x.shape[-1]
        x2 = x.reshape(-1, H)
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        n = x2.shape[0]
        w = weight.contiguous()
        out_dtype = x.dtype if offset else torch.result_type(weight, x)
        y = torch.empty(x.shape, dtype=out_dtype, device=x.device)  # not a view: see rope.py
        rstd = torch.empty(n, dtype=torch.float32, device=x.device)
        _launch_fwd(x2, w, y.view(n, H), rstd, eps, offset)
        ctx.save_for_backward(x2, w, rstd)
        ctx.offset, ctx.x_shape = float(offset), x.shape
        return y

    @staticmethod
    def backward(ctx, dy):
        x2, w, rstd = ctx.saved_tensors
        need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        n, H = x2.shape
        dy2 = dy.reshape(-1, H)
        if dy2.stride(-1) != 1:
            dy2 = dy2.contiguous()
        dx = torch.empty_like(x2) if need_dx else None
        dw = None
        if n == 0 or not (need_dx or need_dw):
            if need_dw:
                dw = torch.zeros_like(w)
            return (dx.view(ctx.x_shape) if need_dx else None), dw, None, None
        block_r, block_h, warps = _tile(H)
        n_blocks = triton.cdiv(n, block_r)
        # With dW: a persistent grid (each program keeps one fp32 partial row). Without: one
        # program per row block, no partials, nothing extra written.
        grid = min(n_blocks, _DW_PROGRAMS_PER_SM * sm_count(x2.device)) if need_dw else n_blocks
        dw_part = (torch.empty((grid, H), dtype=torch.float32, device=x2.device)
                   if need_dw else rstd)  # placeholder pointer when unused
        _rms_norm_bwd_kernel[(grid,)](
            dy2, x2, w, rstd, dx if need_dx else x2, dw_part, x2, n, H,
            dy2.stride(0), x2.stride(0), dx.stride(0) if need_dx else 0, 0, ctx.offset,
            BLOCK_R=block_r, BLOCK_H=block_h, HAS_OFFSET=bool(ctx.offset),
            COMPUTE_DX=need_dx, COMPUTE_DW=need_dw, HAS_RES=False, num_warps=warps)
        if need_dw:
            dw = dw_part.sum(0).to(w.dtype)
        return (dx.view(ctx.x_shape) if need_dx else None), dw, None, None


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    offset: float = 0.0) -> torch.Tensor:
    """Fused RMSNorm; same contract as `rms_norm_reference`. Saves x, w and rstd [rows] (fp32)."""
    return _RMSNormFunction.apply(x, weight, float(eps), float(offset))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x: [..., H], weight: [H] -> [..., H]. Triton kernel or reference, per `use_triton`."""
    if use_triton(x):
        return rms_norm_triton(x, weight, eps, offset)
    return rms_norm_reference(x, weight, eps, offset)


# ------------------------------------------------------------------------------------------------
# Plain functions (no autograd), for the hand-written decoder-layer backward (leantune.engine)
# ------------------------------------------------------------------------------------------------
def rms_norm_fwd(x2: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0,
                 out: torch.Tensor | None = None,
                 quant: tuple[torch.Tensor, torch.Tensor] | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """x2: [n, H] (rows contiguous) -> (y [n, H] in x2.dtype, rstd [n] fp32).

    `out`: where y goes, e.g. the left columns of a wider buffer (rows may be strided).
    `quant`: (codes e4m3 [n, H] contiguous, scale_t fp32 [ceil(H / 128), n], unit column
    stride; a QuantizedRows' targets) written with y's 1 x 128 block quantisation, equal to
    kernels/fp8_quant.quantize_rows(y) bit for bit (module docstring)."""
    n, H = x2.shape
    y = torch.empty_like(x2) if out is None else out
    if quant is not None:
        from .fp8_quant import check_targets

        check_targets(quant, n, H, "rms_norm_fwd")
    if use_triton(x2):
        rstd = torch.empty(n, dtype=torch.float32, device=x2.device)
        _launch_fwd(x2, weight, y, rstd, float(eps), float(offset), quant)
        return y, rstd
    xf = x2.float()
    rstd = torch.rsqrt(xf.pow(2).mean(-1) + eps)
    xn = xf * rstd[:, None]
    if offset:
        y.copy_((xn * (weight.float() + offset)).to(x2.dtype))
    else:
        y.copy_((weight * xn.to(x2.dtype)).to(x2.dtype))
    if quant is not None:
        from .fp8_quant import quantize_rows_reference

        quantize_rows_reference(y, *quant)
    return y, rstd


def rms_norm_bwd(dy2: torch.Tensor, x2: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                 offset: float = 0.0, residual: torch.Tensor | None = None) -> torch.Tensor:
    """dx [n, H] of RMSNorm with a frozen weight, from dy2, x2: [n, H] and the forward's rstd;
    plus `residual` [n, H] (the gradient of a residual connection around the norm) if given,
    added in fp32 before the one rounding."""
    n, H = x2.shape
    if use_triton(x2):
        dx = torch.empty_like(x2)
        if n:
            block_r, block_h, warps = _tile(H)
            res = x2 if residual is None else residual
            _rms_norm_bwd_kernel[(triton.cdiv(n, block_r),)](
                dy2, x2, weight, rstd, dx, rstd, res, n, H, dy2.stride(0), x2.stride(0),
                dx.stride(0), res.stride(0), float(offset), BLOCK_R=block_r, BLOCK_H=block_h,
                HAS_OFFSET=bool(offset), COMPUTE_DX=True, COMPUTE_DW=False,
                HAS_RES=residual is not None, num_warps=warps)
        return dx
    xhat = x2.float() * rstd[:, None]
    g = dy2.float() * (weight.float() + offset)
    c = (g * xhat).mean(-1, keepdim=True)
    dx = (g - xhat * c) * rstd[:, None]
    if residual is not None:
        dx = dx + residual.float()
    return dx.to(x2.dtype)
