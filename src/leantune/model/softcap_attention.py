"""Soft-capped attention (Gemma 2) without the [T, T] scores: query blocks, softmax statistics.

Gemma 2 caps every attention score, s -> c * tanh(s / c), before the softmax; neither SDPA nor
flash attention takes that. Here the scores are made one block of queries at a time ([H, bq, S]
fp32 for the keys S that block can see: causal, and within the window), so the working set is
bq / T of the whole; the forward keeps the log-sum-exp per query ([B, Hq, T] fp32, as flash
does), and the backward recomputes each block's probabilities from it:

    p = exp(cap(s) - lse),  dv += p^T do,  dp = do v^T,  dcap = p (dp - rowsum(do * out)),
    ds = dcap (1 - tanh^2(s / c)),  dq = scale ds k,  dk += scale ds^T q

Which keys a query sees comes from the batch's AttentionMeta: its boolean masks on the "mask"
path (rows of them per block), else the documents of its cu_seqlens ("varlen") or whole rows
("causal"). q: [B, T, Hq, D], k/v: [B, T, Hk, D] (GQA: each k/v head serves Hq / Hk q heads).

Where the Triton kernels run (dispatch.use_triton: CUDA, or a forced "triton" backend under
TRITON_INTERPRET=1) and take the inputs (kernel.supports: D <= 256, half precision on CUDA),
the "varlen" and "causal" paths use the flash-style kernels of kernels/softcap_attention.py
instead: the same out, lse and gradients, each token's document bounds in its row computed here
from cu_seqlens. The "mask" path (arbitrary masks) keeps these query blocks, which are also the
kernels' reference; LEANTUNE_SOFTCAP_KERNEL=0 keeps them everywhere. Under autograd (the
plain model) the kernels run as an autograd.Function, as the query blocks run under autograd.
"""

from __future__ import annotations

import os

import torch

from ..kernels import softcap_attention as kernel
from ..kernels.dispatch import use_triton

BLOCK = 256  # queries per block


def _doc_ids(meta, B: int, T: int, device) -> torch.Tensor | None:
    """[B, T] document id of every token on the varlen path (None: one document a row)."""
    if meta.path != "varlen" or meta.one_document_rows:
        return None
    pos = torch.arange(B * T, device=device, dtype=torch.int32)
    return torch.searchsorted(meta.cu_seqlens[1:].contiguous(), pos, right=True).view(B, T)


def _doc_bounds(meta, B: int, T: int, device):
    """(start, end) int32 [B, T]: where each token's document begins / ends (exclusive) within
    its row, as the kernels take them (None, None: one document a row). Tokens past
    cu_seqlens[-1] form one last document, a document crossing rows is cut at the row's ends,
    as in _doc_ids."""
    docs = _doc_ids(meta, B, T, device)
    if docs is None:
        return None, None
    cu = meta.cu_seqlens.to(torch.int64)
    bounds = torch.cat([cu, cu.new_full((1,), B * T)])
    row0 = torch.arange(B, device=device, dtype=torch.int64)[:, None] * T
    docs = docs.long()
    start = (bounds[docs] - row0).clamp(min=0).to(torch.int32)
    end = (bounds[docs + 1] - row0).clamp(max=T).to(torch.int32)
    return start, end


def _use_kernel(q, k, v, meta) -> bool:
    """Whether the Triton kernels take this call (module docstring)."""
    return (os.environ.get("LEANTUNE_SOFTCAP_KERNEL", "1") != "0"
            and meta.path in ("varlen", "causal") and use_triton(q) and kernel.supports(q, k, v))


def _keys(t0: int, t1: int, window: int | None) -> tuple[int, int]:
    """The key range a causal query block [t0, t1) can see."""
    return (0 if window is None else max(0, t0 - window + 1)), t1


def _block_mask(meta, docs, window, b: int, t0: int, t1: int, k0: int, device) -> torch.Tensor:
    """bool [bq, S]: which keys k0..t1-1 each query t0..t1-1 of row b attends to."""
    if meta.masks:
        return meta.masks[window][b, 0, t0:t1, k0:t1]
    qp = torch.arange(t0, t1, device=device)[:, None]
    kp = torch.arange(k0, t1, device=device)[None, :]
    m = kp <= qp
    if window is not None:
        m = m & (qp - kp < window)
    if docs is not None:
        m = m & (docs[b, t0:t1, None] == docs[b, None, k0:t1])
    return m


def _scores(qb, kb, scale, softcap):
    """qb [bq, Hk, rep, D], kb [S, Hk, D] -> (capped scores, tanh) [Hk, rep, bq, S] fp32."""
    s = torch.einsum("qhrd,khd->hrqk", qb.float(), kb.float()) * scale
    t = torch.tanh(s / softcap)
    return t * softcap, t


def softcap_attention_forward(q, k, v, meta, window: int | None, scale: float, softcap: float,
                              block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out [B, T, Hq, D] in q's dtype, lse [B, Hq, T] fp32)."""
    B, T, Hq, D = q.shape
    if _use_kernel(q, k, v, meta):
        start, end = _doc_bounds(meta, B, T, q.device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            return kernel.SoftcapAttention.apply(q, k, v, window, scale, softcap, start, end)
        return kernel.softcap_attention_fwd(q, k, v, window, scale, softcap, start)
    Hk = k.shape[2]
    rep = Hq // Hk
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    docs = _doc_ids(meta, B, T, q.device)
    for b in range(B):
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            k0, _ = _keys(t0, t1, window)
            capped, _ = _scores(q[b, t0:t1].view(t1 - t0, Hk, rep, D), k[b, k0:t1], scale,
                                softcap)
            capped = capped.masked_fill(~_block_mask(meta, docs, window, b, t0, t1, k0,
                                                     q.device), float("-inf"))
            m = torch.logsumexp(capped, dim=-1)  # [Hk, rep, bq]
            p = torch.exp(capped - m[..., None])
            o = torch.einsum("hrqk,khd->qhrd", p, v[b, k0:t1].float())
            out[b, t0:t1] = o.reshape(t1 - t0, Hq, D).to(q.dtype)
            lse[b, :, t0:t1] = m.reshape(Hq, t1 - t0)
    return out, lse


def softcap_attention_backward(dout, q, k, v, out, lse, meta, window: int | None, scale: float,
                               softcap: float, block: int = BLOCK):
    """(dq, dk, dv) like q, k, v from dout [B, T, Hq, D] and the forward's out and lse."""
    B, T, Hq, D = q.shape
    if _use_kernel(q, k, v, meta):
        start, end = _doc_bounds(meta, B, T, q.device)
        return kernel.softcap_attention_bwd(dout, q, k, v, out, lse, window, scale, softcap,
                                            start, end)
    Hk = k.shape[2]
    rep = Hq // Hk
    dq = torch.empty_like(q)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    delta = (dout.float() * out.float()).sum(-1)  # [B, T, Hq]
    docs = _doc_ids(meta, B, T, q.device)
    for b in range(B):
        for t0 in range(0, T, block):
            t1 = min(T, t0 + block)
            n = t1 - t0
            k0, _ = _keys(t0, t1, window)
            qb = q[b, t0:t1].view(n, Hk, rep, D)
            kb, vb = k[b, k0:t1].float(), v[b, k0:t1].float()
            capped, tanh = _scores(qb, k[b, k0:t1], scale, softcap)
            mask = _block_mask(meta, docs, window, b, t0, t1, k0, q.device)
            m = lse[b, :, t0:t1].view(Hk, rep, n)
            p = torch.exp(capped - m[..., None]).masked_fill(~mask, 0.0)
            do = dout[b, t0:t1].view(n, Hk, rep, D).float()
            dv[b, k0:t1] += torch.einsum("hrqk,qhrd->khd", p, do)
            dp = torch.einsum("qhrd,khd->hrqk", do, vb)
            dl = delta[b, t0:t1].view(n, Hk, rep).permute(1, 2, 0)[..., None]
            ds = p * (dp - dl) * (1 - tanh * tanh) * scale
            dq[b, t0:t1] = torch.einsum("hrqk,khd->qhrd", ds, kb).reshape(n, Hq, D).to(q.dtype)
            dk[b, k0:t1] += torch.einsum("hrqk,qhrd->khd", ds, qb.float())
    return dq, dk.to(k.dtype), dv.to(v.dtype)
