"""Flash attention's varlen aten ops over packed documents, keeping the softmax's log-sum-exp.

torch.ops.aten._flash_attention_forward / _backward (CUDA, fp16/bf16) run over the flattened B*T
tokens with cu_seqlens, so packed rows are exact and GQA is native. Forward returns the
log-sum-exp per (q head, token): backward runs no attention forward again, and attention sinks
(sink_attention.py) are added on top of it. Used by the model's sink attention and by the
engine's attention backend (leantune.engine.attention).

q: [B, T, Hq, D], k/v: [B, T, Hk, D]; cu_seqlens: int32 [segments + 1] over the B*T tokens;
window: None (whole document) or the number of keys a query sees, itself included.

Keys with segments of their own (shared prompts, model/attention.py): k/v are the gathered
[Nk, Hk, D] rows with cu_seqlens_k / max_seqlen_k; a segment with more keys than queries is
causal bottom-right aligned (flash-attn >= 2.1): its last query sees every key.
"""

from __future__ import annotations

import torch

FLASH_OPS = hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(
    torch.ops.aten, "_flash_attention_backward")


def flash_ok(q: torch.Tensor) -> bool:
    """Whether flash attention's ops take `q` (and its k/v): CUDA, half precision."""
    return FLASH_OPS and q.is_cuda and q.dtype in (torch.float16, torch.bfloat16)


def flash_window(window: int | None) -> tuple[bool, int]:
    """-> (is_causal, window_size_left); window_size_right is 0."""
    left = window - 1 if window else -1
    return left == -1, left


def _key_segments(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k):
    """(cu_seqlens_k, max_seqlen_k) flash reads: the keys' own, or the queries' (None)."""
    if cu_seqlens_k is None:
        return cu_seqlens, max_seqlen
    return cu_seqlens_k, max_seqlen_k


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, *t.shape[-2:])  # [B, T, H, D] or [N, H, D] -> [N, H, D]


def flash_forward(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None,
                  scale: float, cu_seqlens_k: torch.Tensor | None = None,
                  max_seqlen_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (out [B, T, Hq, D], lse [Hq, B*T] fp32 log-sum-exp of the scaled scores, rng state).
    cu_seqlens_k / max_seqlen_k: the keys' own segments (None: the queries')."""
    B, T, Hq, D = q.shape
    causal, left = flash_window(window)
    cu_k, max_k = _key_segments(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
        q.reshape(B * T, Hq, D), _rows(k), _rows(v), cu_seqlens, cu_k, max_seqlen, max_k, 0.0,
        causal, False, scale=scale, window_size_left=left, window_size_right=0)
    return out.view(B, T, Hq, D), lse, rng


def flash_backward(dout, q, k, v, out, lse: torch.Tensor, rng: torch.Tensor,
                   cu_seqlens: torch.Tensor, max_seqlen: int, window: int | None,
                   scale: float, cu_seqlens_k: torch.Tensor | None = None,
                   max_seqlen_k: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) for dout [B, T, Hq, D], given forward's inputs, output, lse and rng state
    (dk, dv shaped as k, v: with cu_seqlens_k, the gathered keys')."""
    B, T, Hq, D = q.shape
    causal, left = flash_window(window)
    cu_k, max_k = _key_segments(cu_seqlens, max_seqlen, cu_seqlens_k, max_seqlen_k)
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        dout.reshape(B * T, Hq, D), q.reshape(B * T, Hq, D), _rows(k), _rows(v),
        out.reshape(B * T, Hq, D), lse, cu_seqlens, cu_k, max_seqlen, max_k, 0.0, causal, rng,
        torch.empty(0, device=q.device), scale=scale, window_size_left=left,
        window_size_right=0)
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
