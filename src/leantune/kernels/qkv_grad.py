"""The q/k/v group's output gradient, assembled: out = [rope_bwd(d q) | rope_bwd(d k) | d v].

Attention's backward returns d q [B, T, Hq, D] and d k, d v [B, T, Hk, D] as tensors of their
own, and the q/k/v projections' input gradient is one GEMM over the packed weight, reading
[d q | d k | d v] side by side ([N, (Hq + 2 Hk) D], N = B T), with d q and d k taken back through
RoPE first (the transpose of the forward rotation, kernels/rope.py):
    dx1 = dy1 * c1 + dy2 * s2,   dx2 = dy2 * c2 - dy1 * s1      (halves of each head)
Done by hand that is three strided copies into one buffer and an in-place RoPE pass over its q
and k columns: d q and d k read and written twice. This kernel does it in one pass, one program a
token: it reads the token's d q, d k, d v heads and cos / sin row once, rotates in fp32 and writes
the token's row of `out` once (rounded once, as RoPE's in-place pass rounds: the same values).

With `quant` it also writes the row's e4m3 codes and 1 x 128 block scales (the carrier of
kernels/fp8_quant.QuantizedRows), for the FP8 input-gradient GEMM that reads them next, equal to
quantize_rows(out) bit for bit: a head of 128 is one block (amax over both halves), a head of
256 two (one a half). Other head sizes take no codes (the GEMM quantises as before).

Full rotary only (a partial rotary_dim and q/k-normed layers keep the copies and their own
backward pass: engine/executor.py). qkv_grad_reference is the plain-PyTorch form (the CPU path
and the tests' reference).
"""

from __future__ import annotations

import torch

from .dispatch import num_warps_for, use_triton

try:
    import triton
    import triton.language as tl

    from .fp8_quant import quantize_block, round_to_e4m3
    from .rope import token_cos_sin
except ImportError:  # the package works without Triton (reference path only)
    triton = None

QUANT_HEAD_DIMS = (128, 256)  # head sizes whose 1 x 128 blocks the kernel can form


def quantizable(head_dim: int) -> bool:
    """Whether qkv_grad can write the codes of rows made of heads of `head_dim`."""
    return head_dim in QUANT_HEAD_DIMS


def qkv_grad_reference(dq, dk, dv, cos, sin, out, quant=None) -> torch.Tensor:
    """qkv_grad by hand (module docstring): the copies into out's column blocks and RoPE's
    backward on them in place (kernels/rope.rope_: its reference off the Triton backend), as the
    layer did before; then the codes by quantize_rows' reference."""
    from .rope import rope_

    B, T, Hq, D = dq.shape
    Hk = dk.shape[2]
    parts = out.split([Hq * D, Hk * D, Hk * D], 1)
    for dst, src in zip(parts, (dq, dk, dv)):
        dst.view(B, T, -1, D).copy_(src)
    rope_(parts[0].view(B, T, Hq, D), parts[1].view(B, T, Hk, D), cos, sin, inverse=True)
    if quant is not None:
        from .fp8_quant import quantize_rows_reference

        quantize_rows_reference(out, *quant)
    return out


if triton is not None:

    @triton.jit
    def _codes(Q, ST, tok, y1, y2, h, mh, d, dmask, col0, blk0, W, stride_s,
               HALF: tl.constexpr, ROUND_FP32: tl.constexpr):
        """The e4m3 codes of heads [BLOCK_H] whose halves y1, y2 (fp32 [BLOCK_H, BLOCK_D], as
        stored) start at column col0 + h * 2 HALF of the token's row of W columns: one 1 x 128
        block a head (HALF 64: amax over both halves) or one a half (HALF 128:
        fp8_quant.quantize_block on each), its scale at block blk0 + (the head's blocks)."""
        m = mh[:, None] & dmask[None, :]
        p = Q + tok * W + col0 + h[:, None] * (2 * HALF) + d[None, :]
        if HALF == 64:  # (quantize_block's operations, over the two halves together)
            amax = tl.maximum(tl.max(tl.abs(y1), axis=1), tl.max(tl.abs(y2), axis=1))
            inv = tl.where(amax > 0, (1.0 / tl.where(amax > 0, amax, 1.0)) * 448.0, 1.0)
            q1 = tl.clamp(y1 * inv[:, None], -448.0, 448.0)
            q2 = tl.clamp(y2 * inv[:, None], -448.0, 448.0)
            if ROUND_FP32:
                q1 = round_to_e4m3(q1)
                q2 = round_to_e4m3(q2)
            tl.store(p, q1.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)
            tl.store(p + HALF, q2.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=m)
            tl.store(ST + (blk0 + h) * stride_s + tok, tl.where(amax > 0, amax / 448.0, 1.0),
                     mask=mh)
        else:
            q1, s1 = quantize_block(y1, 1, ROUND_FP32)
            q2, s2 = quantize_block(y2, 1, ROUND_FP32)
            tl.store(p, q1, mask=m)
            tl.store(p + HALF, q2, mask=m)
            tl.store(ST + (blk0 + 2 * h) * stride_s + tok, s1, mask=mh)
            tl.store(ST + (blk0 + 2 * h + 1) * stride_s + tok, s2, mask=mh)

    @triton.jit
    def _heads(X, OUT, Q, ST, tok, b, t, H, sx_b, sx_t, sx_h, stride_o, col0, blk0, W, stride_s,
               c1, c2, s1, s2, d, dmask, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
               ROTATE: tl.constexpr, QUANT: tl.constexpr, ROUND_FP32: tl.constexpr):
        """The token's H heads of X (through RoPE's backward where ROTATE) into its row of OUT
        from column col0 (and their codes, QUANT)."""
        h = tl.arange(0, BLOCK_H)
        mh = h < H
        m = mh[:, None] & dmask[None, :]
        px = X + b * sx_b + t * sx_t + h[:, None] * sx_h + d[None, :]
        x1 = tl.load(px, mask=m, other=0.0)
        x2 = tl.load(px + HALF, mask=m, other=0.0)
        if ROTATE:  # the transpose of y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
            x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
            y1 = (x1f * c1 + x2f * s2).to(OUT.dtype.element_ty)
            y2 = (x2f * c2 - x1f * s1).to(OUT.dtype.element_ty)
        else:
            y1 = x1.to(OUT.dtype.element_ty)
            y2 = x2.to(OUT.dtype.element_ty)
        po = OUT + tok * stride_o + col0 + h[:, None] * (2 * HALF) + d[None, :]
        tl.store(po, y1, mask=m)
        tl.store(po + HALF, y2, mask=m)
        if QUANT:
            _codes(Q, ST, tok, y1.to(tl.float32), y2.to(tl.float32), h, mh, d, dmask, col0,
                   blk0, W, stride_s, HALF, ROUND_FP32)

    @triton.jit
    def _qkv_grad_kernel(DQ, DK, DV, COS, SIN, OUT, Q, ST, T, Hq, Hk,
                         sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                         sc_b, sc_t, ss_b, ss_t, stride_o, stride_s,
                         HALF: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
                         BLOCK_HK: tl.constexpr, QUANT: tl.constexpr,
                         ROUND_FP32: tl.constexpr):
        """One program a token (module docstring)."""
        tok = tl.program_id(0).to(tl.int64)
        b = tok // T
        t = tok % T
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        c1, c2, s1, s2 = token_cos_sin(COS, SIN, b, t, sc_b, sc_t, ss_b, ss_t, d, dmask, HALF)
        D: tl.constexpr = 2 * HALF
        W = (Hq + 2 * Hk) * D
        bq = Hq * D // 128  # the first block of k's columns (codes: D a multiple of 64)
        _heads(DQ, OUT, Q, ST, tok, b, t, Hq, sq_b, sq_t, sq_h, stride_o, 0, 0, W, stride_s,
               c1, c2, s1, s2, d, dmask, HALF, BLOCK_HQ, True, QUANT, ROUND_FP32)
        _heads(DK, OUT, Q, ST, tok, b, t, Hk, sk_b, sk_t, sk_h, stride_o, Hq * D, bq, W,
               stride_s, c1, c2, s1, s2, d, dmask, HALF, BLOCK_HK, True, QUANT, ROUND_FP32)
        _heads(DV, OUT, Q, ST, tok, b, t, Hk, sv_b, sv_t, sv_h, stride_o, (Hq + Hk) * D,
               (Hq + Hk) * D // 128, W, stride_s, c1, c2, s1, s2, d, dmask, HALF, BLOCK_HK,
               False, QUANT, ROUND_FP32)


def qkv_grad(dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, out: torch.Tensor,
             quant: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """out [N, (Hq + 2 Hk) D] = [rope_bwd(dq) | rope_bwd(dk) | dv] (module docstring).

    dq [B, T, Hq, D], dk / dv [B, T, Hk, D] (any strides, the last dim contiguous); cos / sin
    [B, T, D] (RoPE's tables, full rotary); out rows may be strided (columns contiguous).
    `quant`: (codes e4m3 [N, W], scale_t fp32 [W / 128, N]; a QuantizedRows' targets over out)
    written with out's 1 x 128 block quantisation, for D in QUANT_HEAD_DIMS. Returns out."""
    B, T, Hq, D = dq.shape
    Hk = dk.shape[2]
    N, W = B * T, (Hq + 2 * Hk) * D
    if (dk.shape != (B, T, Hk, D) or dv.shape != dk.shape or tuple(out.shape) != (N, W)
            or cos.shape[-1] != D or sin.shape != cos.shape or D % 2):
        raise ValueError(f"qkv_grad: d q {tuple(dq.shape)}, d k {tuple(dk.shape)}, d v "
                         f"{tuple(dv.shape)}, cos {tuple(cos.shape)} and out {tuple(out.shape)} "
                         "do not fit [B, T, H, D] heads, full-rotary tables and an [N, (Hq + 2 Hk)"
                         " D] buffer")
    if quant is not None:
        from .fp8_quant import check_targets

        if not quantizable(D):
            raise ValueError(f"qkv_grad: codes need heads of {' or '.join(map(str, QUANT_HEAD_DIMS))}"
                             f" (whole 1 x 128 blocks), got {D}")
        check_targets(quant, N, W, "qkv_grad")
    if not use_triton(dq):
        return qkv_grad_reference(dq, dk, dv, cos, sin, out, quant)
    if N == 0:
        return out
    ts = [x if x.stride(-1) == 1 else x.contiguous() for x in (dq, dk, dv, cos, sin)]
    dq, dk, dv, cos, sin = ts
    if out.stride(1) != 1:
        raise ValueError("qkv_grad: out's columns must be contiguous")
    half = D // 2
    block_d = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(Hq), triton.next_power_of_2(Hk)
    codes, scale_t = quant if quant is not None else (out, out)
    _qkv_grad_kernel[(N,)](
        dq, dk, dv, cos, sin, out, codes.view(torch.uint8) if quant is not None else codes,
        scale_t, T, Hq, Hk, dq.stride(0), dq.stride(1), dq.stride(2), dk.stride(0),
        dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2), cos.stride(0),
        cos.stride(1), sin.stride(0), sin.stride(1), out.stride(0),
        scale_t.stride(0) if quant is not None else 0, HALF=half, BLOCK_D=block_d,
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, QUANT=quant is not None,
        ROUND_FP32=not dq.is_cuda, num_warps=num_warps_for(2 * block_hq * block_d))
    return out


__all__ = ["QUANT_HEAD_DIMS", "qkv_grad", "qkv_grad_reference", "quantizable"]
