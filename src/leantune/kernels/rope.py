"""Rotary embedding on q and k, HF half-split layout: x * cos + rotate_half(x) * sin.

With x = [x1, x2] (the two halves of head_dim D) and cos = [c1, c2], sin = [s1, s2]:
    y1 = x1 * c1 - x2 * s1
    y2 = x2 * c2 + x1 * s2
Positions are per token: cos/sin rows come from `position_ids`, so packed documents restart their
positions with no extra work here.

The fused version is ONE Triton launch for both q and k (one program per token rotates all of its
q heads and k heads; the token's cos/sin row is read once). It works IN PLACE: the rotated values
overwrite q and k, which in the model are fresh projection outputs that nothing else reads (the
returned tensors are the same storage, marked dirty for autograd). Autograd can't let a Function
with two outputs modify a view in place, so a view that is merely its whole base reshaped (the
model's `q_proj(x).view(B, T, H, D)`) is rotated through its base. Leaves that require grad, other
views, and inputs whose layout can't be written in place (stride 0, or a last dim that is not
contiguous) are copied first instead. Backward applies the transposed rotation (for HF's cos/sin,
whose halves are equal, that is the inverse rotation: sin negated) in place on the incoming
gradients, so RoPE allocates no activation memory either way. Those gradient tensors are consumed:
a caller that hands its own tensors to `torch.autograd.grad(..., grad_outputs=...)` should pass
copies (broadcast grads, and dq/dk that are one tensor, are copied here first).
"""

from __future__ import annotations

import torch

from .dispatch import num_warps_for, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope_reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, T, Hq, D], k: [B, T, Hk, D], cos/sin: [B, T, D] -> rotated (q, k)."""
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


# ------------------------------------------------------------------------------------------------
# Triton kernel
# ------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def token_cos_sin(COS, SIN, b, t, sc_b, sc_t, ss_b, ss_t, d, dmask, HALF: tl.constexpr):
        """Token (b, t)'s cos and sin rows as halves (c1, c2, s1, s2), fp32 [1, BLOCK_D] each."""
        cp = COS + b * sc_b + t * sc_t + d
        sp = SIN + b * ss_b + t * ss_t + d
        c1 = tl.load(cp, mask=dmask, other=0.0).to(tl.float32)[None, :]
        c2 = tl.load(cp + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s1 = tl.load(sp, mask=dmask, other=0.0).to(tl.float32)[None, :]
        s2 = tl.load(sp + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
        return c1, c2, s1, s2

    @triton.jit
    def _rope_kernel(Q, K, COS, SIN, T, Hq, Hk,
                     sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sc_b, sc_t, ss_b, ss_t,
                     HALF: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BACKWARD: tl.constexpr):
        """One program per token (b, t): rotate its Hq q heads and Hk k heads in place.

        Every load is issued before the first store (q and k might alias as far as the compiler
        knows, so a store in between would serialise the memory round trips).
        BACKWARD applies the transpose of the forward map:
            dx1 = dy1*c1 + dy2*s2,  dx2 = dy2*c2 - dy1*s1
        i.e. the forward formula with (s1, s2) replaced by (-s2, -s1).
        """
        tok = tl.program_id(0).to(tl.int64)
        b = tok // T
        t = tok % T
        d = tl.arange(0, BLOCK_D)
        dmask = d < HALF
        hq = tl.arange(0, BLOCK_HQ)
        hk = tl.arange(0, BLOCK_HK)
        mq = (hq < Hq)[:, None] & dmask[None, :]
        mk = (hk < Hk)[:, None] & dmask[None, :]
        pq = Q + b * sq_b + t * sq_t + hq[:, None] * sq_h + d[None, :]
        pk = K + b * sk_b + t * sk_t + hk[:, None] * sk_h + d[None, :]
        q1 = tl.load(pq, mask=mq, other=0.0)
        q2 = tl.load(pq + HALF, mask=mq, other=0.0)
        k1 = tl.load(pk, mask=mk, other=0.0)
        k2 = tl.load(pk + HALF, mask=mk, other=0.0)
        c1, c2, s1, s2 = token_cos_sin(COS, SIN, b, t, sc_b, sc_t, ss_b, ss_t, d, dmask, HALF)
        if BACKWARD:
            sb = -s2
            se = -s1
        else:
            sb = s1
            se = s2
        # y1 = x1*c1 - x2*sb, y2 = x2*c2 + x1*se, in fp32
        q1f, q2f = q1.to(tl.float32), q2.to(tl.float32)
        k1f, k2f = k1.to(tl.float32), k2.to(tl.float32)
        tl.store(pq, (q1f * c1 - q2f * sb).to(q1.dtype), mask=mq)
        tl.store(pq + HALF, (q2f * c2 + q1f * se).to(q1.dtype), mask=mq)
        tl.store(pk, (k1f * c1 - k2f * sb).to(k1.dtype), mask=mk)
        tl.store(pk + HALF, (k2f * c2 + k1f * se).to(k1.dtype), mask=mk)


def _writable(t: torch.Tensor) -> bool:
    """Whether the kernel may overwrite `t` (see the module docstring)."""
    if t.stride(-1) != 1 or any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape)):
        return False  # not addressable as [.., D] rows, or broadcast (writes would collide)
    if t._base is not None:
        return False  # autograd: a Function returning 2 tensors can't modify a view in place
    return not (t.requires_grad and t.is_leaf)  # nor a leaf that requires grad


def _unview(t: torch.Tensor) -> torch.Tensor:
    """The base of a view that is just its whole base reshaped (q = q_proj(x).view(B, T, H, D)),
    so that it can be rotated in place (`_writable`); any other tensor unchanged."""
    b = t._base
    if (b is not None and b.numel() == t.numel() and b.data_ptr() == t.data_ptr()
            and b.dtype == t.dtype and t.is_contiguous() and b.is_contiguous()
            and b.requires_grad == t.requires_grad):  # else the base lacks t's autograd history
        # (e.g. a view made inside a custom Function's forward, whose base has no grad_fn)
        return b
    return t


def _rows_ok(t: torch.Tensor) -> torch.Tensor:
    """cos/sin are only read: any strides over (B, T) work (even expanded), last dim contiguous."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _launch(q, k, cos, sin, backward: bool) -> None:
    """Rotate q [B, T, Hq, D] and k [B, T, Hk, D] in place (strided over B, T, H)."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    if B * T == 0:
        return
    half = D // 2
    block_d = triton.next_power_of_2(half)
    block_hq, block_hk = triton.next_power_of_2(Hq), triton.next_power_of_2(Hk)
    _rope_kernel[(B * T,)](
        q, k, cos, sin, T, Hq, Hk,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        HALF=half, BLOCK_D=block_d, BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BACKWARD=backward,
        num_warps=num_warps_for(2 * max(block_hq, block_hk) * block_d))


def _buffer(t: torch.Tensor, shape: torch.Size, other: torch.Tensor | None = None) -> torch.Tensor:
    """`t` itself if it can be rotated in place as `shape`, else a contiguous copy."""
    ok = _writable(t) and (t.shape == shape or t.is_contiguous())
    if ok and other is not None:
        ok = t.data_ptr() != other.data_ptr()  # q and k (or dq and dk) must not be one tensor
    return t if ok else t.clone(memory_format=torch.contiguous_format)


class _RoPEFunction(torch.autograd.Function):
    """q, k: the tensors to rotate, either [B, T, H, D] or (un-viewed) the contiguous base of
    such a view; q_shape / k_shape: their [B, T, H, D] shapes."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, q_shape, k_shape):
        qo = _buffer(q, q_shape)
        ko = _buffer(k, k_shape, qo)
        cos, sin = _rows_ok(cos), _rows_ok(sin)
        _launch(qo.view(q_shape), ko.view(k_shape), cos, sin, backward=False)
        dirty = [t for t, o in ((q, qo), (k, ko)) if o is t]
        if dirty:
            ctx.mark_dirty(*dirty)
        ctx.save_for_backward(cos, sin)
        ctx.shapes = q_shape, k_shape
        return qo, ko

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        q_shape, k_shape = ctx.shapes
        # Gradients are rotated in place. Copied first where that is unsafe: broadcast (stride-0)
        # grads, e.g. from .sum(), and dq/dk being one tensor (e.g. both from one add's backward).
        dq = _buffer(dq, q_shape)
        dk = _buffer(dk, k_shape, dq)
        _launch(dq.view(q_shape), dk.view(k_shape), cos, sin, backward=True)
        return dq, dk, None, None, None, None


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused RoPE, in place on q and k where allowed (module docstring); returns (q, k)."""
    if q.shape[-1] % 2:
        raise ValueError(f"rope needs an even head_dim, got {q.shape[-1]}")
    qo, ko = _RoPEFunction.apply(_unview(q), _unview(k), cos, sin, q.shape, k.shape)
    return qo.view(q.shape), ko.view(k.shape)


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [B, T, Hq, D], k: [B, T, Hk, D], cos/sin: [B, T, D] -> rotated (q, k).

    On the Triton path q and k are overwritten (see the module docstring): pass tensors you no
    longer need unrotated.
    """
    if use_triton(q):
        return apply_rope_triton(q, k, cos, sin)
    return apply_rope_reference(q, k, cos, sin)


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
          inverse: bool = False) -> None:
    """Rotate q [B, T, Hq, D] and k [B, T, Hk, D] in place, no autograd (the hand-written layer
    backward, leantune.engine); inverse=True applies the transposed rotation (backward)."""
    if use_triton(q):
        _launch(q, k, _rows_ok(cos), _rows_ok(sin), backward=inverse)
        return
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    h = q.shape[-1] // 2
    for t in (q, k):
        if not inverse:
            t.copy_(t * c + _rotate_half(t) * s)
            continue
        # transpose of the forward map: d1 * c1 + d2 * s2, d2 * c2 - d1 * s1
        d1, d2 = t[..., :h].clone(), t[..., h:].clone()
        t[..., :h] = d1 * c[..., :h] + d2 * s[..., h:]
        t[..., h:] = d2 * c[..., h:] - d1 * s[..., :h]
