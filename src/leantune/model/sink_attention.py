"""Attention sinks (gpt-oss) on top of an attention kernel's log-sum-exp: no [T, T] scores kept.

A sink is a learned logit b per q head that joins every softmax's denominator and attends to
nothing (its value is 0). Given plain attention's output o and log-sum-exp L = log sum_j exp(s_j)
per (token, q head), sink attention (the softmax over [scores, b]) is

    L' = logaddexp(L, b),   o' = o * exp(L - L')                                  (`add_sinks`)

Backward: attention's own backward given o', L' and the output gradient g returns exactly the
sink attention's dq, dk, dv (its probabilities exp(S - L') are the sink-inclusive ones, and so is
its D = rowsum(g * o')), and db = -sum over tokens of exp(b - L') * rowsum(g * o')
(`sinks_grad`, fp32, returned in the sinks' dtype).

The attention under it: flash attention's varlen ops on CUDA in half precision (flash.py);
elsewhere a math reference over the packed documents (`math_forward` / `math_backward`, fp32,
one row's [Hq, T, T] scores at a time: CPU, fp32 and tests), which is the same algebra as flash's
backward, so the CPU tests exercise the sink path the GPU takes. Between forward and backward
only L' [Hq, B*T] fp32 (and flash's rng state) is kept besides the inputs and the output.

q: [B, T, Hq, D], k/v: [B, T, Hk, D] (GQA: q head h reads k/v head h // (Hq / Hk)); cu_seqlens:
int32 [segments + 1] over the B*T tokens; window: None or the number of keys a query sees, itself
included; sinks: [Hq].
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..utils.tensors import rowdot
from .flash import flash_backward, flash_forward, flash_ok


def add_sinks(out: torch.Tensor, lse: torch.Tensor,
              sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention's (out [B, T, Hq, D], lse [Hq, B*T] fp32) -> sink attention's (out', lse')."""
    B, T, Hq, _ = out.shape
    lse_s = torch.logaddexp(lse, sinks.float()[:, None])
    keep = torch.exp(lse - lse_s).t().reshape(B, T, Hq, 1)  # 1 - the sink's probability
    return out * keep.to(out.dtype), lse_s


def _row_dot(dout: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """rowsum(dout * out) per (q head, token): [Hq, B*T] fp32 (attention backward's D)."""
    return rowdot(dout, out).flatten(0, 1).t()


def sinks_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
               sinks: torch.Tensor) -> torch.Tensor:
    """d sinks [Hq] (in sinks' dtype) for dout, given sink attention's out' and lse'."""
    p_sink = torch.exp(sinks.float()[:, None] - lse)  # [Hq, B*T]
    return -(p_sink * _row_dot(dout, out)).sum(1).to(sinks.dtype)


def _repeated(t: torch.Tensor, Hq: int) -> torch.Tensor:
    """k or v [B, T, Hk, D] -> [B*T, Hq, D] fp32, each head repeated for its Hq / Hk q heads."""
    return t.reshape(-1, t.shape[2], t.shape[3]).float().repeat_interleave(Hq // t.shape[2], 1)


def _masked_scores(q, k, cu_seqlens, window, scale):
    """-> (scaled scores [Hq, N, N] fp32, -inf where a query may not see a key: another
    document, a later token or outside the window; q [N, Hq, D] fp32; `_repeated` k) for the
    N = B*T tokens of q, k, whose documents cu_seqlens delimits (the math path: one row)."""
    B, T, Hq, D = q.shape
    qf, kf = q.reshape(B * T, Hq, D).float(), _repeated(k, Hq)
    i = torch.arange(B * T, device=q.device)
    doc = torch.searchsorted(cu_seqlens.long(), i, right=True)
    see = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    if window is not None:
        see &= (i[:, None] - i[None, :]) < window
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * scale
    return scores.masked_fill(~see, float("-inf")), qf, kf


def _row_offsets(cu_seqlens: torch.Tensor, b: int, T: int) -> torch.Tensor:
    """The document offsets within row b of T tokens (documents never cross rows)."""
    cu = cu_seqlens.long()
    inside = cu[(cu >= b * T) & (cu <= (b + 1) * T)] - b * T
    return torch.unique(torch.cat([inside, inside.new_tensor([0, T])]))


def math_forward(q, k, v, cu_seqlens, window, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention within the packed documents in fp32 -> (out [B, T, Hq, D] in q's dtype,
    lse [Hq, B*T] fp32), the values flash attention's forward returns. One row at a time, so
    its scores are [Hq, T, T] (as the mask path's), not over all B*T tokens."""
    B, T, Hq, _ = q.shape
    outs, lses = [], []
    for b in range(B):
        r = slice(b, b + 1)
        scores, _, _ = _masked_scores(q[r], k[r], _row_offsets(cu_seqlens, b, T), window, scale)
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse[..., None])
        outs.append(torch.einsum("hqk,khd->qhd", probs, _repeated(v[r], Hq)))
        lses.append(lse)
    return torch.cat(outs).reshape(q.shape).to(q.dtype), torch.cat(lses, dim=1)


def math_backward(dout, q, k, v, out, lse, cu_seqlens, window, scale):
    """(dq, dk, dv) as flash attention's backward computes them from forward's out and lse
    (P = exp(S - lse), dS = P * (dout . v - rowsum(dout * out))), in fp32, one row at a time."""
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    grads = []
    for b in range(B):
        r, cols = slice(b, b + 1), slice(b * T, (b + 1) * T)
        scores, qf, kf = _masked_scores(q[r], k[r], _row_offsets(cu_seqlens, b, T), window,
                                        scale)
        probs = torch.exp(scores - lse[:, cols, None])
        g = dout[r].reshape(T, Hq, D).float()
        dv = torch.einsum("hqk,qhd->khd", probs, g)
        dp = torch.einsum("qhd,khd->hqk", g, _repeated(v[r], Hq))
        ds = probs * (dp - _row_dot(dout[r], out[r])[..., None])
        dq = torch.einsum("hqk,khd->qhd", ds, kf) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, qf) * scale
        grads.append((dq, dk, dv))
    dq, dk, dv = (torch.cat(t) for t in zip(*grads))
    dk, dv = (t.view(B, T, Hk, Hq // Hk, D).sum(3) for t in (dk, dv))  # onto their k/v head
    return dq.view(q.shape).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def sink_forward(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale):
    """-> (out' [B, T, Hq, D], lse' [Hq, B*T] fp32, flash's rng state: None on the math path)."""
    if flash_ok(q):
        out, lse, rng = flash_forward(q, k, v, cu_seqlens, max_seqlen, window, scale)
    else:
        (out, lse), rng = math_forward(q, k, v, cu_seqlens, window, scale), None
    return *add_sinks(out, lse, sinks), rng


def sink_backward(dout, q, k, v, sinks, out, lse, rng, cu_seqlens, max_seqlen, window, scale,
                  need_dsinks: bool = True):
    """(dq, dk, dv, dsinks) for dout, given sink_forward's inputs and results (dsinks None
    unless `need_dsinks`: frozen sinks)."""
    if flash_ok(q):
        dq, dk, dv = flash_backward(dout, q, k, v, out, lse, rng, cu_seqlens, max_seqlen,
                                    window, scale)
    else:
        dq, dk, dv = math_backward(dout, q, k, v, out, lse, cu_seqlens, window, scale)
    return dq, dk, dv, sinks_grad(dout, out, lse, sinks) if need_dsinks else None


class SinkAttention(torch.autograd.Function):
    """Sink attention within packed documents under autograd (`sink_attention_varlen`)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, cu_seqlens, max_seqlen, window, scale):
        out, lse, rng = sink_forward(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale)
        ctx.save_for_backward(q, k, v, sinks, out, lse, rng, cu_seqlens)
        ctx.args = (max_seqlen, window, scale)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, sinks, out, lse, rng, cu_seqlens = ctx.saved_tensors
        grads = sink_backward(dout.contiguous(), q, k, v, sinks, out, lse, rng, cu_seqlens,
                              *ctx.args, need_dsinks=ctx.needs_input_grad[3])
        return (*grads, None, None, None, None)


def sink_attention_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sinks: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
                          window: int | None, scale: float) -> torch.Tensor:
    """Causal attention with sinks within the documents cu_seqlens delimits over the flattened
    B*T tokens: q [B, T, Hq, D], k/v [B, T, Hk, D], sinks [Hq] -> [B, T, Hq, D] (q's dtype).
    Flash attention on CUDA in half precision, the fp32 math reference elsewhere."""
    return SinkAttention.apply(q, k, v, sinks, cu_seqlens, max_seqlen, window, scale)
