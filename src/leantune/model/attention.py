"""Attention over packed rows, chosen once per batch.

Paths (the decision and all metadata are made once per forward in `AttentionMeta.build`, then
reused by every layer; nothing here reads device memory back to the host):
- "varlen": CUDA and torch.nn.attention.varlen.varlen_attn exists: flash attention over the
  flattened B*T tokens with cu_seqlens; exact for packed rows, native GQA (no repeated k/v), no
  transposes. Used for single-document rows too (cu_seqlens at row boundaries).
- "causal": every row is one document, no varlen: plain causal SDPA.
- "mask": elsewhere (CPU): SDPA with a block-diagonal causal boolean mask built from the host-side
  segment lengths. Correct on any device; O(T^2) memory, so it is the fallback.
Sliding-window layers (Mistral) attend to the previous `window` tokens including themselves.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except Exception:  # torch < 2.10
    _varlen_attn, _VARLEN_PARAMS = None, set()

HAS_VARLEN = _varlen_attn is not None and "window_size" in _VARLEN_PARAMS

_FORCED_PATH: str | None = None  # tests: force "mask" / "causal" / "varlen"


def force_attention_path(path: str | None) -> None:
    global _FORCED_PATH
    _FORCED_PATH = path


@dataclass
class AttentionMeta:
    """Per-batch attention metadata shared by all layers."""

    path: str
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    masks: dict = field(default_factory=dict)  # window (None = full) -> bool mask [B, 1, T, T]
    dense: bool = False  # varlen path, every row one document: full-window layers may use cuDNN

    @classmethod
    def build(cls, batch_shape: tuple[int, int], device: torch.device, seq_lens: list[int] | None,
              cu_seqlens: torch.Tensor | None, max_seqlen: int,
              windows: set, dtype: torch.dtype = torch.bfloat16) -> "AttentionMeta":
        B, T = batch_shape
        single_doc = seq_lens is None or len(seq_lens) == B
        path = _FORCED_PATH
        if path is None:
            # flash attention (varlen) runs in fp16/bf16 only; fp32 on CUDA takes SDPA
            if device.type == "cuda" and HAS_VARLEN and dtype in (torch.float16, torch.bfloat16):
                path = "varlen"
            elif single_doc and windows == {None}:
                path = "causal"
            else:
                path = "mask"
        if path == "varlen":
            if cu_seqlens is None:
                seq_lens = seq_lens or [T] * B
                cu_seqlens = _cu_from_lens(seq_lens, device)
                max_seqlen = max(seq_lens)
            return cls("varlen", cu_seqlens.to(device=device, dtype=torch.int32), max_seqlen,
                       dense=single_doc and _CUDNN_DENSE)
        if path == "causal":
            return cls("causal")
        # "mask": block-diagonal causal masks, one per distinct window, built on the host.
        seq_lens = seq_lens or [T] * B
        doc = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens)).view(B, T)
        pos = torch.arange(T)
        causal = pos[None, :, None] >= pos[None, None, :]
        same = doc[:, :, None] == doc[:, None, :]
        masks = {}
        for w in windows:
            m = causal & same
            if w is not None:
                m = m & ((pos[:, None] - pos[None, :]) < w)[None]
            masks[w] = m[:, None].to(device, non_blocking=True)
        return cls("mask", masks=masks)


def _cu_from_lens(seq_lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    return cu.to(device, non_blocking=True)


_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa kwarg


def _sdpa(q, k, v, scale, **kw):
    """q: [B, Hq, T, D], k/v: [B, Hk, T, D]; GQA natively where SDPA supports it."""
    if k.shape[1] != q.shape[1] and _SDPA_GQA and q.device.type == "cuda":
        return F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True, **kw)
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, **kw)


# cuDNN's fused attention (SDPA backend) runs causal attention over whole rows about 1.8x faster
# than flash attention 2 on an H200 (fwd+bwd, Llama-3.1-8B shapes; bench/profile_step.py). It is
# used for rows that hold one document each and full-window layers; packed rows take varlen flash.
# Off with LEANTUNE_CUDNN_ATTENTION=0; switched off for the process if cuDNN refuses the inputs.
_CUDNN_DENSE = os.environ.get("LEANTUNE_CUDNN_ATTENTION", "1") != "0"
_CUDNN_GQA = _SDPA_GQA  # try cuDNN's native GQA first (enable_gqa)


def set_cudnn_attention(enabled: bool) -> None:
    global _CUDNN_DENSE
    _CUDNN_DENSE = enabled


def _bhtd(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2)  # [B, T, H, D] <-> [B, H, T, D] (a view)


def _repeat_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    B, T, Hk, D = t.shape
    return t[:, :, :, None].expand(B, T, Hk, rep, D).reshape(B, T, Hk * rep, D)


def _cudnn_causal(q, k, v, scale):
    """q: [B, T, Hq, D], k/v: [B, T, Hk, D] -> [B, T, Hq, D] (None if cuDNN refuses)."""
    global _CUDNN_DENSE
    from torch.nn.attention import SDPBackend, sdpa_kernel

    global _CUDNN_GQA
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    kw = {}
    if Hk != Hq and _CUDNN_GQA:
        kw["enable_gqa"] = True
    elif Hk != Hq:  # GQA where cuDNN wants the heads repeated (autograd sums their grads back)
        k, v = _repeat_heads(k, Hq // Hk), _repeat_heads(v, Hq // Hk)
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), is_causal=True, scale=scale,
                                                 **kw)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        if kw:  # this build's cuDNN path has no native GQA: repeat the heads from now on
            _CUDNN_GQA = False
            return _cudnn_causal(q, k, v, scale)
        _CUDNN_DENSE = False
        return None
    return out.transpose(1, 2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
              window: int | None, scale: float) -> torch.Tensor:
    """q: [B, T, Hq, D], k/v: [B, T, Hk, D] -> [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    if meta.path == "varlen" and meta.dense and window is None and _CUDNN_DENSE:
        out = _cudnn_causal(q, k, v, scale)
        if out is not None:
            return out
    if meta.path == "varlen":
        kw = {"scale": scale, "window_size": (window - 1 if window else -1, 0)}
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = k.shape[2] != Hq
        out = _varlen_attn(q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D),
                           v.reshape(B * T, -1, D), meta.cu_seqlens, meta.cu_seqlens,
                           meta.max_seqlen, meta.max_seqlen, **kw)
        return out.view(B, T, Hq, D)
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if meta.path == "causal":
        out = _sdpa(qt, kt, vt, scale, is_causal=True)
    else:
        out = _sdpa(qt, kt, vt, scale, attn_mask=meta.masks[window])
    return out.transpose(1, 2)


# ------------------------------------------------------------------------------------------------
# Without autograd, for the hand-written decoder-layer backward (model/fused_layer.py). On the
# varlen path the flash-attention ops (and, for rows of one document, cuDNN's) are called
# directly: the forward's log-sum-exp is kept, so backward needs no attention forward again.
# Elsewhere backward re-runs attention under autograd.
# ------------------------------------------------------------------------------------------------
_FLASH_OPS = hasattr(torch.ops.aten, "_flash_attention_forward") and hasattr(
    torch.ops.aten, "_flash_attention_backward")


def _flash_window(window: int | None) -> tuple[bool, int]:
    left = window - 1 if window else -1
    return left == -1, left  # (is_causal, window_size_left); window_size_right is 0


_CUDNN_OPS = hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention") and hasattr(
    torch.ops.aten, "_scaled_dot_product_cudnn_attention_backward")


def cudnn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Causal cuDNN attention through its aten op, keeping what its backward op needs.

    q: [B, T, Hq, D], k/v: [B, T, Hk, D] -> (out [B, T, Hq, D], ("cudnn", state)), state being
    the log-sum-exp ([B, Hq, T, 1] fp32) and the op's bookkeeping outputs; None if cuDNN refuses
    the inputs (then the caller takes flash attention, and so does every later call)."""
    global _CUDNN_DENSE, _CUDNN_GQA
    rep = q.shape[2] // k.shape[2]
    if rep > 1 and not _CUDNN_GQA:
        k, v = _repeat_heads(k, rep), _repeat_heads(v, rep)
    try:
        out, lse, cq, ck, mq, mk, seed, offset, _ = torch.ops.aten._scaled_dot_product_cudnn_attention(
            _bhtd(q), _bhtd(k), _bhtd(v), None, True, 0.0, True, False, scale=scale)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:
        if rep > 1 and _CUDNN_GQA:  # no native GQA in this build: repeat the heads from now on
            _CUDNN_GQA = False
            return cudnn_forward(q, k, v, scale)
        _CUDNN_DENSE = False
        return None
    return _bhtd(out), ("cudnn", (lse, cq, ck, mq, mk, seed, offset, rep > 1 and not _CUDNN_GQA))


def cudnn_backward(dout, q, k, v, out, state, scale):
    """(dq, dk, dv) of cudnn_forward from its kept state; all [B, T, H, D] like the inputs."""
    lse, cq, ck, mq, mk, seed, offset, repeated = state
    Hk = k.shape[2]
    rep = q.shape[2] // Hk
    if repeated:
        k, v = _repeat_heads(k, rep), _repeat_heads(v, rep)
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        _bhtd(dout), _bhtd(q), _bhtd(k), _bhtd(v), _bhtd(out), lse, seed, offset, None, cq, ck,
        mq, mk, 0.0, True, scale=scale)
    dq, dk, dv = _bhtd(dq), _bhtd(dk), _bhtd(dv)
    if repeated:  # the repeated heads' gradients sum back onto their k/v head
        B, T, _, D = dk.shape
        dk = dk.reshape(B, T, Hk, rep, D).sum(3)
        dv = dv.reshape(B, T, Hk, rep, D).sum(3)
    return dq, dk, dv


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
                      window: int | None, scale: float, for_backward: bool = False):
    """q: [B, T, Hq, D], k/v: [B, T, Hk, D] -> (out [B, T, Hq, D], aux for attention_backward).

    aux: flash attention's (log-sum-exp, rng state) or cuDNN's ("cudnn", state), so backward
    runs no attention forward again; on other paths None (backward re-runs attention under
    autograd), or, with `for_backward` (a recompute right before backward), the autograd graph
    of this call, so backward does not run attention a third time."""
    B, T, Hq, D = q.shape
    dense = meta.path == "varlen" and meta.dense and window is None and _CUDNN_DENSE
    if dense and _CUDNN_OPS and q.is_cuda:
        res = cudnn_forward(q, k, v, scale)
        if res is not None:
            return res
        dense = False
    if meta.path == "varlen" and _FLASH_OPS and not dense:
        causal, left = _flash_window(window)
        out, lse, rng, _, _ = torch.ops.aten._flash_attention_forward(
            q.view(B * T, Hq, D), k.view(B * T, -1, D), v.view(B * T, -1, D), meta.cu_seqlens,
            meta.cu_seqlens, meta.max_seqlen, meta.max_seqlen, 0.0, causal, False, scale=scale,
            window_size_left=left, window_size_right=0)
        return out.view(B, T, Hq, D), (lse, rng)
    if for_backward:
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = attention(*leaves, meta, window, scale)
        return out.detach(), ("graph", out, leaves)
    with torch.no_grad():
        return attention(q, k, v, meta, window, scale), None


def attention_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       out: torch.Tensor, aux, meta: AttentionMeta, window: int | None,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv) for dout [B, T, Hq, D], given attention_forward's inputs/outputs."""
    B, T, Hq, D = q.shape
    if aux is not None and isinstance(aux[0], str) and aux[0] == "cudnn":
        try:
            return cudnn_backward(dout, q, k, v, out, aux[1], scale)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError:  # cuDNN took the forward but refuses the backward: flash from now
            set_cudnn_attention(False)
            aux = None  # -> attention re-run under autograd below
    if aux is not None and isinstance(aux[0], str):  # ("graph", out, leaves)
        _, out_graph, leaves = aux
        return torch.autograd.grad(out_graph, leaves, dout)
    if aux is not None:
        lse, rng = aux
        causal, left = _flash_window(window)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.view(B * T, Hq, D), q.view(B * T, Hq, D), k.view(B * T, -1, D),
            v.view(B * T, -1, D), out.view(B * T, Hq, D), lse, meta.cu_seqlens, meta.cu_seqlens,
            meta.max_seqlen, meta.max_seqlen, 0.0, causal, rng, torch.empty(0, device=q.device),
            scale=scale, window_size_left=left, window_size_right=0)
        return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape)
    with torch.enable_grad():
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        o = attention(*leaves, meta, window, scale)
        return torch.autograd.grad(o, leaves, dout)
