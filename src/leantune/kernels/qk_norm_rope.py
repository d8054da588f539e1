"""Per-head RMSNorm of q and k followed by RoPE (Qwen3's attention), in one pass each way.

Per head row x [D] (q: Hq heads, k: Hk heads per token), with the norm's weight w [D]:

    y = w * (x * rstd).to(dtype)          rstd = 1 / sqrt(mean(x^2) + eps)   (offset 0: Qwen3)
    y = (x * rstd * (offset + w))         (offset 1: Gemma-style norms)
    out = rope(y) = y * cos + rotate_half(y) * sin        (HF half-split layout)

The norm's output is rounded to the input dtype before the rotation, as transformers does.
Backward (frozen norm weights: no dw) rotates the incoming gradient back (the transpose of the
rotation), then back-propagates through the norm, recomputing rstd from x:

    g = rope^T(dout);  gw = g * (offset + w);  xhat = x * rstd
    dx = rstd * (gw - xhat * mean(gw * xhat))

One Triton program per token handles all of its q and k heads (the token's cos/sin row is read
once). The hand-written layer backward (leantune.engine) keeps the un-normed q/k and calls
`qk_norm_rope_fwd` (out of place) and `qk_norm_rope_bwd_` (in place on the gradients); the
reference is the model's own path (RMSNorm modules, then kernels.apply_rope).
"""

from __future__ import annotations

import torch

from .dispatch import num_warps_for, use_triton
from .rmsnorm import rms_norm_reference
from .rope import apply_rope_reference, rope_

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None


def qk_norm_rope_reference(q, k, wq, wk, eps: float, offset: float, cos, sin):
    """q: [B, T, Hq, D], k: [B, T, Hk, D], wq/wk: [D], cos/sin: [B, T, D] -> (q', k')."""
    return apply_rope_reference(rms_norm_reference(q, wq, eps, offset),
                                rms_norm_reference(k, wk, eps, offset), cos, sin)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    from .rope import token_cos_sin

    @triton.jit
    def _load_halves(P, mask, HALF: tl.constexpr):
        x1 = tl.load(P, mask=mask, other=0.0)
        x2 = tl.load(P + HALF, mask=mask, other=0.0)
        return x1, x2

    @triton.jit
    def _rstd(x1f, x2f, eps, D: tl.constexpr):
        return tl.rsqrt((tl.sum(x1f * x1f, axis=1) + tl.sum(x2f * x2f, axis=1)) / D + eps)

    @triton.jit
    def _fwd_tile(PX, PO, W, d, dmask, mask, c1, c2, s1, s2, eps, offset,
                  HALF: tl.constexpr, HAS_OFFSET: tl.constexpr):
        """Norm + rotate the [heads, D] tile at PX (loaded as two halves) into PO."""
        x1, x2 = _load_halves(PX, mask, HALF)
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        rstd = _rstd(x1f, x2f, eps, 2 * HALF)[:, None]
        w1 = tl.load(W + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            y1 = x1f * rstd * (w1 + offset)
            y2 = x2f * rstd * (w2 + offset)
        else:  # round the normalised x first, as transformers does
            y1 = (x1f * rstd).to(x1.dtype).to(tl.float32) * w1
            y2 = (x2f * rstd).to(x1.dtype).to(tl.float32) * w2
        y1 = y1.to(x1.dtype).to(tl.float32)  # the norm's output, rounded before the rotation
        y2 = y2.to(x1.dtype).to(tl.float32)
        tl.store(PO, (y1 * c1 - y2 * s1).to(x1.dtype), mask=mask)
        tl.store(PO + HALF, (y2 * c2 + y1 * s2).to(x1.dtype), mask=mask)

    @triton.jit
    def _bwd_tile(PG, PX, W, d, dmask, mask, c1, c2, s1, s2, eps, offset,
                  HALF: tl.constexpr, HAS_OFFSET: tl.constexpr):
        """The gradient tile at PG (of the rotated output) -> the gradient of x, in place."""
        dy1, dy2 = _load_halves(PG, mask, HALF)
        x1, x2 = _load_halves(PX, mask, HALF)
        dy1f, dy2f = dy1.to(tl.float32), dy2.to(tl.float32)
        g1 = dy1f * c1 + dy2f * s2  # the rotation's transpose
        g2 = dy2f * c2 - dy1f * s1
        x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
        rstd = _rstd(x1f, x2f, eps, 2 * HALF)[:, None]
        w1 = tl.load(W + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + d, mask=dmask, other=0.0).to(tl.float32)[None, :]
        if HAS_OFFSET:
            w1 = w1 + offset
            w2 = w2 + offset
        g1 = g1 * w1
        g2 = g2 * w2
        xh1, xh2 = x1f * rstd, x2f * rstd
        c = (tl.sum(g1 * xh1, axis=1) + tl.sum(g2 * xh2, axis=1))[:, None] / (2 * HALF)
        tl.store(PG, ((g1 - xh1 * c) * rstd).to(dy1.dtype), mask=mask)
        tl.store(PG + HALF, ((g2 - xh2 * c) * rstd).to(dy1.dtype), mask=mask)

    @triton.jit
    def _qk_norm_rope_kernel(Q, K, QO, KO, WQ, WK, COS, SIN, T, Hq, Hk,
                             sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
                             so_b, so_t, so_h, sko_b, sko_t, sko_h,
                             sc_b, sc_t, ss_b, ss_t, eps, offset,
                             HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                             BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
                             HAS_OFFSET: tl.constexpr, BACKWARD: tl.constexpr):
        """One program per token (b, t). Forward: QO, KO = norm+rope(Q, K). Backward: QO, KO
        hold the gradients of the output, overwritten with those of Q, K (the un-normed x)."""
        tok = tl.program_id(0).to(tl.int64)
        b = tok // T
        t = tok % T
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        hq = tl.arange(0, BLOCK_HQ)
        hk = tl.arange(0, BLOCK_HK)
        mq = (hq < Hq)[:, None] & dmask[None, :]
        mk = (hk < Hk)[:, None] & dmask[None, :]
        c1, c2, s1, s2 = token_cos_sin(COS, SIN, b, t, sc_b, sc_t, ss_b, ss_t, d, dmask, HALF)
        pq = Q + b * sq_b + t * sq_t + hq[:, None] * sq_h + d[None, :]
        pk = K + b * sk_b + t * sk_t + hk[:, None] * sk_h + d[None, :]
        pqo = QO + b * so_b + t * so_t + hq[:, None] * so_h + d[None, :]
        pko = KO + b * sko_b + t * sko_t + hk[:, None] * sko_h + d[None, :]
        if BACKWARD:
            _bwd_tile(pqo, pq, WQ, d, dmask, mq, c1, c2, s1, s2, eps, offset, HALF, HAS_OFFSET)
            _bwd_tile(pko, pk, WK, d, dmask, mk, c1, c2, s1, s2, eps, offset, HALF, HAS_OFFSET)
        else:
            _fwd_tile(pq, pqo, WQ, d, dmask, mq, c1, c2, s1, s2, eps, offset, HALF, HAS_OFFSET)
            _fwd_tile(pk, pko, WK, d, dmask, mk, c1, c2, s1, s2, eps, offset, HALF, HAS_OFFSET)


def _launch(q, k, qo, ko, wq, wk, cos, sin, eps: float, offset: float, backward: bool) -> None:
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    if B * T == 0:
        return
    cos = cos if cos.stride(-1) == 1 else cos.contiguous()
    sin = sin if sin.stride(-1) == 1 else sin.contiguous()
    half = D // 2
    block_d = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(Hq), triton.next_power_of_2(Hk)
    _qk_norm_rope_kernel[(B * T,)](
        q, k, qo, ko, wq.contiguous(), wk.contiguous(), cos, sin, T, Hq, Hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        qo.stride(0), qo.stride(1), qo.stride(2), ko.stride(0), ko.stride(1), ko.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1), float(eps), float(offset),
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        HAS_OFFSET=bool(offset), BACKWARD=backward,
        num_warps=num_warps_for(2 * max(block_hq, block_hk) * block_d))


def _check(q: torch.Tensor) -> None:
    if q.shape[-1] % 2 or q.stride(-1) != 1:
        raise ValueError(f"q/k norm + rope needs an even head_dim with contiguous heads, got "
                         f"shape {tuple(q.shape)}, strides {q.stride()}")


def qk_norm_rope_fwd(q: torch.Tensor, k: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor,
                     eps: float, offset: float, cos: torch.Tensor, sin: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, T, Hq, D], k [B, T, Hk, D] (any strides over B, T, H) -> normed and rotated
    copies, views of one new buffer [B, T, Hq + Hk, D]; q and k are not modified."""
    _check(q)
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    out = torch.empty(B, T, Hq + Hk, D, dtype=q.dtype, device=q.device)
    qo, ko = out[:, :, :Hq], out[:, :, Hq:]
    if use_triton(q):
        _launch(q, k, qo, ko, wq, wk, cos, sin, eps, offset, backward=False)
    else:
        qr, kr = qk_norm_rope_reference(q, k, wq, wk, eps, offset, cos, sin)
        qo.copy_(qr)
        ko.copy_(kr)
    return qo, ko


def qk_norm_rope_bwd_(dq: torch.Tensor, dk: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      wq: torch.Tensor, wk: torch.Tensor, eps: float, offset: float,
                      cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: dq [B, T, Hq, D], dk [B, T, Hk, D], the gradients of qk_norm_rope_fwd's
    outputs, become the gradients of its inputs q, k (the un-normed values)."""
    _check(dq)
    if use_triton(dq):
        _launch(q, k, dq, dk, wq, wk, cos, sin, eps, offset, backward=True)
        return
    rope_(dq, dk, cos, sin, inverse=True)
    for g, x, w in ((dq, q, wq), (dk, k, wk)):
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        xhat = xf * rstd
        gw = g.float() * (w.float() + offset)
        g.copy_((gw - xhat * (gw * xhat).mean(-1, keepdim=True)) * rstd)
