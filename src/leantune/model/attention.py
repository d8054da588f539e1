"""Attention over packed rows: the metadata, built once per batch, and the plain (autograd) op.

`AttentionMeta.build` runs once per forward (in `CausalLM.hidden_states`) and every layer reuses
it; nothing here reads device memory back to the host. Paths:
- "varlen": CUDA, half precision, and torch.nn.attention.varlen.varlen_attn (torch >= 2.10):
  flash attention over the flattened B*T tokens with cu_seqlens; exact for packed rows, native
  GQA, no transposes. Rows that hold one document each take causal SDPA instead (one_document_rows;
  PyTorch picks its fastest kernel, cuDNN or flash), except sliding-window layers.
- "causal": every row is one document and no layer has a window: plain causal SDPA.
- "mask": elsewhere (CPU, fp32 on CUDA): SDPA with a block-diagonal causal boolean mask built
  from the host-side segment lengths. Correct on any device; O(T^2) memory, so the fallback.
- "cache": generation (leantune.generate): each layer writes its new keys/values into the KV
  cache the metadata carries and attends over the whole cache through a mask built on the
  device (`cache_attention`), so a decode step has static shapes and reads nothing back.
Sliding-window layers (Mistral) attend to the previous `window` tokens including themselves.

Attention sinks (gpt-oss): a learned logit per head joins every softmax's denominator and
attends to nothing, so a query may give less than all of its weight to the keys. Neither SDPA
nor varlen_attn takes one. On the varlen and causal paths they are added on top of flash
attention's log-sum-exp (sink_attention.py: exact, nothing [T, T] kept; a "causal" batch is
varlen with one document per row); on the mask and cache paths the softmax is computed here with
the sink as an extra column (`_scores_attention`: the scores [B, Hq, T, T] in fp32).

The hand-written layer backward (leantune.engine) has attention backends of its own that keep
the softmax statistics for backward; they read the same metadata.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .sink_attention import sink_attention_varlen
from .softcap_attention import softcap_attention_forward

try:
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except Exception:  # torch < 2.10
    _varlen_attn, _VARLEN_PARAMS = None, set()

HAS_VARLEN = _varlen_attn is not None and "window_size" in _VARLEN_PARAMS
PATHS = ("varlen", "causal", "mask")


@dataclass
class AttentionMeta:
    """Per-batch attention metadata shared by all layers.

    path: "varlen" | "causal" | "mask" (module docstring).
    cu_seqlens: [segments + 1] int32 on the device (varlen), max_seqlen: a host int.
    masks: window (None = full) -> bool mask [B, 1, T, T] (mask path).
    one_document_rows: every row holds one document (then causal attention over whole rows is
        exact for full-window layers, and the fastest kernels apply).
    kv_cache: "cache" path: the KV cache (leantune.generate.cache.KVCache); a layer calls
        kv_cache.update(layer_idx, k, v) with its new k/v [B, T, Hk, D] and attends over the
        [B, S, Hk, D] buffers it returns, masks[window] being [B, 1, T, S]."""

    path: str
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    masks: dict = field(default_factory=dict)
    one_document_rows: bool = False
    kv_cache: object | None = None

    @classmethod
    def build(cls, batch_shape: tuple[int, int], device: torch.device, seq_lens: list[int] | None,
              cu_seqlens: torch.Tensor | None, max_seqlen: int, windows: set,
              dtype: torch.dtype = torch.bfloat16, path: str | None = None) -> "AttentionMeta":
        """Metadata for a [B, T] batch whose segments have the host-side lengths `seq_lens`
        (None: one document per row). `path` forces a path (tests, benchmarks); None chooses."""
        B, T = batch_shape
        single_doc = seq_lens is None or len(seq_lens) == B
        if path is None:
            if device.type == "cuda" and HAS_VARLEN and dtype in (torch.float16, torch.bfloat16):
                path = "varlen"
            elif single_doc and windows == {None}:
                path = "causal"
            else:
                path = "mask"
        if path not in PATHS:
            raise ValueError(f"attention path must be one of {PATHS}, got {path!r}")
        if path == "varlen":
            if cu_seqlens is None:
                seq_lens = seq_lens or [T] * B
                cu_seqlens = _cu_from_lens(seq_lens, device)
                max_seqlen = max(seq_lens)
            return cls("varlen", cu_seqlens.to(device=device, dtype=torch.int32), max_seqlen,
                       one_document_rows=single_doc)
        if path == "causal":
            return cls("causal", one_document_rows=True)
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
        return cls("mask", masks=masks, one_document_rows=single_doc)


def _cu_from_lens(seq_lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    return cu.to(device, non_blocking=True)


SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)  # enable_gqa kwarg


def repeat_kv_heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[B, T, Hk, D] -> [B, T, Hk * rep, D], each k/v head repeated for its `rep` q heads."""
    B, T, Hk, D = t.shape
    return t[:, :, :, None].expand(B, T, Hk, rep, D).reshape(B, T, Hk * rep, D)


def _sdpa(q, k, v, scale, **kw):
    """q: [B, T, Hq, D], k/v: [B, T, Hk, D] -> [B, T, Hq, D]; GQA natively where SDPA has it."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1 and SDPA_GQA and q.device.type == "cuda":
        kw["enable_gqa"] = True
    elif rep > 1:
        k, v = repeat_kv_heads(k, rep), repeat_kv_heads(v, rep)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         scale=scale, **kw)
    return out.transpose(1, 2)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                    scale: float, kv_cache=None, window: int | None = None) -> torch.Tensor:
    """q: [B, T, Hq, D] over cached k/v [B, S, Hk, D] where the bool `mask` [B, 1, T, S] allows
    -> [B, T, Hq, D]. Given the KVCache `kv_cache` (its pad and start) and the layer's `window`,
    a decode step (T <= 16) where Triton runs takes the decode attention kernel instead, the
    same mask computed in-kernel (kernels/decode_attention.py; LEANTUNE_DECODE_ATTENTION=0: off).
    Else SDPA, GQA without repeating k/v: the Hq / Hk query heads that share a k/v head
    (q head h reads k/v head h // rep) become rep * T queries of that head, so SDPA sees Hk heads
    and any of its kernels (the memory-efficient one with a mask on CUDA) applies."""
    from ..kernels.decode_attention import decode_attention, decode_attention_on

    if kv_cache is not None and decode_attention_on(q):
        return decode_attention(q, k, v, kv_cache.pad, kv_cache.start, window, scale)
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    rep = Hq // Hk
    q = q.view(B, T, Hk, rep, D).permute(0, 2, 3, 1, 4).reshape(B, Hk, rep * T, D)
    out = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask.repeat(1, 1, rep, 1), scale=scale)
    return out.view(B, Hk, rep, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, Hq, D)


def _scores_attention(q, k, v, mask, scale, sinks=None, softcap=None):
    """Softmax attention computed from the scores [B, Hq, T, S] in fp32, for what SDPA does not
    take: `sinks` [Hq], one more logit per head in the denominator that attends to nothing
    (gpt-oss), and `softcap`, scores -> softcap * tanh(scores / softcap) before the mask
    (Gemma 2). q: [B, T, Hq, D], k/v: [B, S, Hk, D], mask: bool [B, 1, T, S] -> [B, T, Hq, D]."""
    B, T, Hq, D = q.shape
    rep = Hq // k.shape[2]
    if rep > 1:
        k, v = repeat_kv_heads(k, rep), repeat_kv_heads(v, rep)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, Hq, 1, 1).expand(B, Hq, T, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhqk,bkhd->bqhd", probs.to(v.dtype), v)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMeta,
              window: int | None, scale: float, sinks: torch.Tensor | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """Causal attention within documents. q: [B, T, Hq, D], k/v: [B, T, Hk, D] -> [B, T, Hq, D]
    (the "cache" path: k/v are the cache's [B, S, Hk, D]). `sinks` [Hq]: attention sinks
    (module docstring). `softcap` (Gemma 2): the scores are soft-capped, computed whole on the
    mask and cache paths, in query blocks elsewhere (model/softcap_attention.py)."""
    B, T, Hq, D = q.shape
    if softcap:
        if meta.path in ("mask", "cache"):
            return _scores_attention(q, k, v, meta.masks[window], scale, sinks, softcap)
        if sinks is not None:
            raise ValueError("attention soft-capping with sinks runs on the mask and cache paths")
        return softcap_attention_forward(q, k, v, meta, window, scale, softcap)[0]
    if sinks is not None:
        if meta.path in ("mask", "cache"):
            return _scores_attention(q, k, v, meta.masks[window], scale, sinks)
        if meta.path == "varlen":
            return sink_attention_varlen(q, k, v, sinks, meta.cu_seqlens, meta.max_seqlen,
                                         window, scale)
        rows = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=q.device)  # "causal"
        return sink_attention_varlen(q, k, v, sinks, rows, T, window, scale)
    if meta.path == "cache":
        return cache_attention(q, k, v, meta.masks[window], scale, meta.kv_cache, window)
    if meta.path == "causal" or (meta.path == "varlen" and meta.one_document_rows
                                 and window is None):
        return _sdpa(q, k, v, scale, is_causal=True)
    if meta.path == "varlen":
        kw = {"scale": scale, "window_size": (window - 1 if window else -1, 0)}
        if "enable_gqa" in _VARLEN_PARAMS:
            kw["enable_gqa"] = k.shape[2] != Hq
        out = _varlen_attn(q.reshape(B * T, Hq, D), k.reshape(B * T, -1, D),
                           v.reshape(B * T, -1, D), meta.cu_seqlens, meta.cu_seqlens,
                           meta.max_seqlen, meta.max_seqlen, **kw)
        return out.view(B, T, Hq, D)
    return _sdpa(q, k, v, scale, attn_mask=meta.masks[window])
