"""Shared-prompt attention as two plain ragged calls merged by their log-sum-exps.

A shared-prompt batch (data/preference.py _pack_shared) has query segments [prompt + chosen]
(causal over themselves) and [rejected], whose keys are [prompt + rejected] (causal,
bottom-right aligned). Today one flash-attention call runs over gathered keys
(engine/attention.py). cuDNN runs causal attention faster than flash, but takes only segments
whose queries are their own keys, so here the same attention is split:

    self    every query segment over its own rows, causal            one ragged call, no gather
    prefix  each segment with a prefix (a rejected completion) over   one ragged call over the
            its prefix rows (the prompt), no mask                      gathered rows (small)

and the rejected rows' two partial results merged exactly: with l = logaddexp(l_self, l_pre),
out = exp(l_self - l) out_self + exp(l_pre - l) out_pre. Backward runs both calls' backward with
the merged output and log-sum-exp (each call's own part of the softmax is then exact), and sums
the prefix call's d q onto the rejected rows and its d k, d v onto the prompt rows.

Only full-window layers split (a window would mask the prefix call). The ragged calls run on
cuDNN (`_cudnn_attention_forward` with cum_seq) or flash varlen, or, off CUDA, a per-segment
reference in plain PyTorch (tests).

Shapes: q [N, Hq, D], k/v [N, Hk, D] (N = B x T tokens); log-sum-exps [Hq, N] fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.attention import PrefixSplit  # noqa: F401  (built per batch by AttentionMeta)


# --------------------------------------------------------------------------------------------
# Ragged attention calls: (out [Nq, Hq, D], lse [Hq, Nq] fp32, aux) and their backward
# --------------------------------------------------------------------------------------------

def _reference_forward(q, k, v, cu_q, cu_k, causal, scale):
    """Per segment in fp32 (causal: bottom-right aligned; the calls here have equal lengths)."""
    out = torch.empty_like(q)
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    rep = q.shape[1] // k.shape[1]
    for s in range(cu_q.numel() - 1):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        c, d = int(cu_k[s]), int(cu_k[s + 1])
        if b == a:
            continue
        qs = q[a:b].float().transpose(0, 1)  # [H, Tq, D]
        ks = k[c:d].float().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[c:d].float().repeat_interleave(rep, 1).transpose(0, 1)
        sc = qs @ ks.transpose(1, 2) * scale
        if causal:
            tq, tk = b - a, d - c
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
            sc = sc.masked_fill(~mask, float("-inf"))
        l_ = torch.logsumexp(sc, -1)  # [H, Tq]
        out[a:b] = (torch.exp(sc - l_[..., None]) @ vs).transpose(0, 1).to(q.dtype)
        lse[:, a:b] = l_
    return out, lse


def _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale):
    """The flash-style backward from the given output and log-sum-exp (fp32 per segment)."""
    dq, dk, dv = (torch.zeros_like(t, dtype=torch.float32) for t in (q, k, v))
    H, Hk = q.shape[1], k.shape[1]
    rep = H // Hk
    for s in range(cu_q.numel() - 1):
        a, b = int(cu_q[s]), int(cu_q[s + 1])
        c, d = int(cu_k[s]), int(cu_k[s + 1])
        if b == a:
            continue
        qs = q[a:b].float().transpose(0, 1)
        ks = k[c:d].float().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[c:d].float().repeat_interleave(rep, 1).transpose(0, 1)
        do = dout[a:b].float().transpose(0, 1)
        o = out[a:b].float().transpose(0, 1)
        sc = qs @ ks.transpose(1, 2) * scale
        if causal:
            tq, tk = b - a, d - c
            mask = torch.ones(tq, tk, dtype=torch.bool, device=q.device).tril(tk - tq)
            sc = sc.masked_fill(~mask, float("-inf"))
        p = torch.exp(sc - lse[:, a:b, None])
        dvs = p.transpose(1, 2) @ do
        dp = do @ vs.transpose(1, 2)
        ds = p * (dp - (do * o).sum(-1, keepdim=True)) * scale
        dq[a:b] += (ds @ ks).transpose(0, 1)
        dks = (ds.transpose(1, 2) @ qs).transpose(0, 1)  # [Tk, H, D]
        dk[c:d] += dks.reshape(d - c, Hk, rep, -1).sum(2)
        dv[c:d] += dvs.transpose(0, 1).reshape(d - c, Hk, rep, -1).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _cudnn_lse(lse: torch.Tensor, nq: int, h: int) -> torch.Tensor:
    """cuDNN's ragged log-sum-exp -> [Hq, Nq] (it is [Nq, Hq, 1] or [Hq, Nq]-shaped)."""
    if lse.shape[0] == nq and lse.numel() == nq * h:
        return lse.reshape(nq, h).t()
    return lse.reshape(h, nq)


def ragged_forward(kind, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """One ragged attention call on `kind` ("cudnn", "flash" or "reference") -> (out, lse
    [Hq, Nq] fp32, aux for ragged_backward)."""
    if kind == "flash":
        out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
        return out, lse, rng
    if kind == "cudnn":
        out, lse, _, _, _, _, seed, offset, _ = torch.ops.aten._cudnn_attention_forward(
            q, k, v, None, cu_q, cu_k, max_q, max_k, True, 0.0, causal, False, scale=scale)
        return out, _cudnn_lse(lse, q.shape[0], q.shape[1]), (lse.shape, seed, offset)
    out, lse = _reference_forward(q, k, v, cu_q, cu_k, causal, scale)
    return out, lse, None


def ragged_backward(kind, dout, q, k, v, out, lse, aux, cu_q, cu_k, max_q, max_k, causal,
                    scale):
    """(dq, dk, dv) of one ragged call, given the output and log-sum-exp [Hq, Nq] to use."""
    if kind == "flash":
        return torch.ops.aten._flash_attention_backward(
            dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, causal, aux,
            torch.empty(0, device=q.device), scale=scale)
    if kind == "cudnn":
        shape, seed, offset = aux
        raw = (lse.t() if shape[0] == q.shape[0] else lse).contiguous().reshape(shape)
        return torch.ops.aten._cudnn_attention_backward(
            dout, q, k, v, out, raw, seed, offset, torch.empty(0, device=q.device), cu_q, cu_k,
            max_q, max_k, 0.0, causal, scale=scale)
    return _reference_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal, scale)


# --------------------------------------------------------------------------------------------
# The split attention
# --------------------------------------------------------------------------------------------

@dataclass
class SplitState:
    """What backward needs: the merged log-sum-exp [Hq, N] fp32 and each call's aux."""
    lse: torch.Tensor
    aux_self: object
    aux_prefix: object
    kind: str


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])


def split_forward(kind, q, k, v, meta, scale):
    """q [B, T, Hq, D], k/v [B, T, Hk, D], a shared-prompt AttentionMeta (prefix_split set) ->
    (out [B, T, Hq, D], SplitState)."""
    ps = meta.prefix_split
    qf, kf, vf = _rows(q), _rows(k), _rows(v)
    out, lse, aux1 = ragged_forward(kind, qf, kf, vf, meta.cu_seqlens, meta.cu_seqlens,
                                    meta.max_seqlen, meta.max_seqlen, True, scale)
    out2, lse2, aux2 = ragged_forward(
        kind, qf.index_select(0, ps.q_rows), kf.index_select(0, ps.prefix_rows),
        vf.index_select(0, ps.prefix_rows), ps.cu_q, ps.cu_k, ps.max_q, ps.max_k, False, scale)
    l1 = lse.index_select(1, ps.q_rows)  # [Hq, N2]
    merged = torch.logaddexp(l1, lse2)
    w1 = torch.exp(l1 - merged).t()[..., None]  # [N2, Hq, 1]
    w2 = torch.exp(lse2 - merged).t()[..., None]
    rows = (out.index_select(0, ps.q_rows).float() * w1 + out2.float() * w2).to(out.dtype)
    out.index_copy_(0, ps.q_rows, rows)
    lse = lse.index_copy(1, ps.q_rows, merged).contiguous()
    return out.view(q.shape), SplitState(lse, aux1, aux2, kind)


def split_backward(dout, q, k, v, out, state: SplitState, meta, scale):
    """(dq, dk, dv) shaped as q, k, v, for dout [B, T, Hq, D] and forward's merged output."""
    ps, kind = meta.prefix_split, state.kind
    qf, kf, vf = _rows(q), _rows(k), _rows(v)
    dof, of = _rows(dout).contiguous(), _rows(out)
    dq, dk, dv = ragged_backward(kind, dof, qf, kf, vf, of, state.lse, state.aux_self,
                                 meta.cu_seqlens, meta.cu_seqlens, meta.max_seqlen,
                                 meta.max_seqlen, True, scale)
    dq2, dk2, dv2 = ragged_backward(
        kind, dof.index_select(0, ps.q_rows), qf.index_select(0, ps.q_rows),
        kf.index_select(0, ps.prefix_rows), vf.index_select(0, ps.prefix_rows),
        of.index_select(0, ps.q_rows), state.lse.index_select(1, ps.q_rows).contiguous(),
        state.aux_prefix, ps.cu_q, ps.cu_k, ps.max_q, ps.max_k, False, scale)
    # (the rows each index names are distinct: the sums are the same in any order)
    dq = dq.index_add(0, ps.q_rows, dq2)
    dk = dk.index_add(0, ps.prefix_rows, dk2)
    dv = dv.index_add(0, ps.prefix_rows, dv2)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
