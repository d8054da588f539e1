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

Shared prompts (preference pairs, data/preference.py): one document [prompt | chosen | rejected]
per pair; its query segments are [prompt + chosen] and [rejected], and the rejected segment's
keys are the prompt's rows gathered again followed by its own (`shared_kv_index`): k/v are
gathered as k_flat[kv_index] with key segments of their own (cu_seqlens_k), and flash's causal
mask, bottom-right aligned when a segment has more keys than queries, lets rejected token i see
the prompt and rejected[0..i], never chosen. The mask path builds the same visibility from the
segment lengths (`segment_masks`). Soft-capping and sinks are refused for such batches (the
preference objective packs those models' pairs unshared).

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
        [B, S, Hk, D] buffers it returns, masks[window] being [B, 1, T, S].
    kv_index / cu_seqlens_k / max_seqlen_k: shared-prompt batches (module docstring): [Nk]
        int64 rows each key segment gathers, [segments + 1] int32 key segments, their longest
        (host int); None / 0 otherwise."""

    path: str
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int = 0
    masks: dict = field(default_factory=dict)
    one_document_rows: bool = False
    kv_cache: object | None = None
    kv_index: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    max_seqlen_k: int = 0

    @classmethod
    def build(cls, batch_shape: tuple[int, int], device: torch.device, seq_lens: list[int] | None,
              cu_seqlens: torch.Tensor | None, max_seqlen: int, windows: set,
              dtype: torch.dtype = torch.bfloat16, path: str | None = None,
              kv_index: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
              max_seqlen_k: int = 0, seq_lens_k: list[int] | None = None) -> "AttentionMeta":
        """Metadata for a [B, T] batch whose segments have the host-side lengths `seq_lens`
        (None: one document per row). `path` forces a path (tests, benchmarks); None chooses.
        kv_index, cu_seqlens_k, max_seqlen_k, seq_lens_k: a shared-prompt batch's key segments
        (PackedBatch; module docstring), None for any other."""
        B, T = batch_shape
        shared = kv_index is not None
        single_doc = not shared and (seq_lens is None or len(seq_lens) == B)
        if shared and (not seq_lens or not seq_lens_k):
            raise ValueError("a shared-prompt batch needs the host lengths seq_lens and seq_lens_k")
        if shared and path == "causal":
            raise ValueError("a shared-prompt batch runs on the varlen or mask attention path, "
                             "not causal")
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
            meta = cls("varlen", cu_seqlens.to(device=device, dtype=torch.int32), max_seqlen,
                       one_document_rows=single_doc)
            if shared:
                if cu_seqlens_k is None:
                    cu_seqlens_k = _cu_from_lens(seq_lens_k, device)
                meta.kv_index = kv_index.to(device, non_blocking=True)
                meta.cu_seqlens_k = cu_seqlens_k.to(device=device, dtype=torch.int32)
                meta.max_seqlen_k = max_seqlen_k or max(seq_lens_k)
            return meta
        if path == "causal":
            return cls("causal", one_document_rows=True)
        # "mask": block-diagonal causal masks, one per distinct window, built on the host.
        seq_lens = seq_lens or [T] * B
        masks = segment_masks(seq_lens, seq_lens_k if shared else None, B, T, windows)
        masks = {w: m.to(device, non_blocking=True) for w, m in masks.items()}
        meta = cls("mask", masks=masks, one_document_rows=single_doc)
        if shared:
            meta.kv_index, meta.max_seqlen_k = kv_index, max_seqlen_k or max(seq_lens_k)
        return meta


def segment_masks(seq_lens: list[int], seq_lens_k: list[int] | None, B: int, T: int,
                  windows: set) -> dict:
    """window -> bool [B, 1, T, T] on the host: token q sees token k when both are in one
    document, k's position is not after q's (within `window` of it), and k is no other
    completion's token. Without `seq_lens_k` every segment is a document of its own (causal by
    position = by index). With it (shared prompts), a segment s whose keys outnumber its queries
    (p = seq_lens_k[s] - seq_lens[s] > 0) is a rejected completion: it belongs to segment s-1's
    document, whose first p tokens are the prompt, and its positions continue from p."""
    q = torch.tensor(seq_lens, dtype=torch.long)
    S = q.numel()
    pre = (torch.tensor(seq_lens_k, dtype=torch.long) - q) if seq_lens_k is not None else (
        torch.zeros(S, dtype=torch.long))
    seg = torch.repeat_interleave(torch.arange(S), q)  # [B*T]
    cu = torch.cumsum(q, 0) - q
    off = torch.arange(seg.numel()) - cu[seg]
    rejected = pre > 0
    group = (torch.arange(S) - rejected.long())[seg]  # a rejected segment joins its prompt's
    nxt = torch.cat([pre[1:], pre.new_zeros(1)])  # the next segment's prompt: this one's
    prompt_len = torch.where(nxt > 0, nxt, q)[seg]  # (a plain document: all "prompt")
    pos = off + pre[seg]
    branch = torch.where(rejected[seg], 2, (off >= prompt_len).long())  # 0 prompt, 1, 2
    group, pos, branch = group.view(B, T), pos.view(B, T), branch.view(B, T)
    base = ((group[:, :, None] == group[:, None, :]) & (pos[:, :, None] >= pos[:, None, :])
            & ((branch[:, None, :] == 0) | (branch[:, :, None] == branch[:, None, :])))
    masks = {}
    for w in windows:
        m = base if w is None else base & ((pos[:, :, None] - pos[:, None, :]) < w)
        masks[w] = m[:, None]
    return masks


def shared_kv_index(seq_lens: list[int], seq_lens_k: list[int]) -> torch.Tensor:
    """[sum(seq_lens_k)] int64 flat row indices the key/value segments gather: key segment s
    is the first p = seq_lens_k[s] - seq_lens[s] rows of query segment s-1 (a pair's prompt,
    for its rejected completion), then query segment s's own rows; p = 0 (any other segment):
    its own rows. Built on the host once per batch."""
    q = torch.tensor(seq_lens, dtype=torch.long)
    k = torch.tensor(seq_lens_k, dtype=torch.long)
    pre = k - q
    prev = torch.cat([q.new_zeros(1), q[:-1]])
    if len(seq_lens) != len(seq_lens_k) or (pre < 0).any() or (pre > prev).any():
        raise ValueError("shared_kv_index: each key segment holds its query segment, plus at "
                         "most the previous segment's tokens")
    cu = torch.cumsum(q, 0) - q  # each query segment's first row
    segk = torch.repeat_interleave(torch.arange(len(seq_lens)), k)
    j = torch.arange(segk.numel()) - (torch.cumsum(k, 0) - k)[segk]  # offset in its segment
    p = pre[segk]
    start_prev = cu[(segk - 1).clamp(min=0)]
    return torch.where(j < p, start_prev + j, cu[segk] + j - p)


def _cu_from_lens(seq_lens: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(seq_lens, dtype=torch.int32), 0)
    return cu.to(device, non_blocking=True)


def check_shared(meta: "AttentionMeta", sinks, softcap) -> None:
    """Soft-capping and sinks have no shared-prompt path: a one-line error for such a batch."""
    if meta.kv_index is not None and (softcap or sinks is not None):
        raise ValueError("attention soft-capping and sinks do not run on shared-prompt batches; "
                         "pack the pairs unshared (LEANTUNE_SHARED_PROMPT=0)")


def gather_kv(k: torch.Tensor, v: torch.Tensor, kv_index: torch.Tensor):
    """k/v [N, Hk, D] (or [B, T, Hk, D]) -> their rows kv_index, [Nk, Hk, D] each."""
    k, v = k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:])
    return k.index_select(0, kv_index), v.index_select(0, kv_index)


def scatter_kv_grads(dk_g: torch.Tensor, dv_g: torch.Tensor, kv_index: torch.Tensor,
                     shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv's backward: the gathered rows' gradients [Nk, Hk, D] summed back onto the
    token rows (a prompt row gets both of its segments'), shaped `shape` ([B, T, Hk, D]). A
    row takes at most two terms, so the sum is the same in any order (deterministic)."""
    out = []
    for g in (dk_g, dv_g):
        rows = g.new_zeros((shape[:-2].numel(), *g.shape[1:]))
        out.append(rows.index_add_(0, kv_index, g).view(shape))
    return out[0], out[1]


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
    check_shared(meta, sinks, softcap)
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
        k, v = k.reshape(B * T, -1, D), v.reshape(B * T, -1, D)
        cu_k, max_k = meta.cu_seqlens, meta.max_seqlen
        if meta.kv_index is not None:  # shared prompts: the keys' own segments, gathered
            k, v = gather_kv(k, v, meta.kv_index)  # (index_select: backward sums duplicates)
            cu_k, max_k = meta.cu_seqlens_k, meta.max_seqlen_k
        out = _varlen_attn(q.reshape(B * T, Hq, D), k, v, meta.cu_seqlens, cu_k,
                           meta.max_seqlen, max_k, **kw)
        return out.view(B, T, Hq, D)
    return _sdpa(q, k, v, scale, attn_mask=meta.masks[window])
