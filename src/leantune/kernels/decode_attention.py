"""Attention of a few new tokens per row over the KV cache (decode steps), masks in-kernel.

    decode_attention(q [B, T, Hq, D], k_cache/v_cache [B, S, Hk, D], pad [B], start [1],
                     window, scale) -> out [B, T, Hq, D]

The cache's rule (generate/cache.py): row b's query t sits at slot i = start + t and sees the
slots j with pad[b] <= j <= i (and i - j < window on sliding-window layers), plus always its
own slot j == i (a padding query attends to itself alone). Here that mask is computed from
pad / start / window inside the kernel: no [B, 1, T, S] mask is read, and since `start` is
read on the device (a pointer, never .item()), the call has static shapes, reads nothing back
to the host and can be captured in a CUDA graph.

Layout: one program per (row, kv head) takes the rep = Hq / Hk query heads that share that
head together, as rep * T query rows of one tile [BLOCK_M, D]: each key/value block is read
once for all of them (GQA without repeating k/v). It walks the live slots only, from the
lowest slot any of its queries sees (max(pad, start - window + 1), or start for a padding
query) to start + T - 1, in blocks of BLOCK_N, with an online softmax in fp32 (scores scaled
by scale * log2(e), exp2). Slots beyond start + T - 1 (the unwritten rest of the cache) are
never read.

Long caches (S > SPLIT_SLOTS) split the slots in `splits` chunks ("flash decoding"): programs
(row, kv head, chunk) write unnormalised partial outputs with their max and sum, and a second
kernel merges the chunks of each (row, kv head). The split count depends on S and the grid
only (static shapes): B * Hk * splits about one wave of the GPU, chunks of at least SPLIT_SLOTS
slots. A chunk holding no live slot writes max -inf, sum 0 and zeros, and weighs nothing.

Forward only (decoding has no backward). The reference, `decode_attention_reference`, is the
dense computation: the mask built from the same rule, fp32 softmax over the whole cache.
Switch: LEANTUNE_DECODE_ATTENTION=0 keeps the model on its SDPA path (`decode_attention_on`).
"""

from __future__ import annotations

import os

import torch

from .dispatch import sm_count, use_triton

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None

MAX_TOKENS = 16  # new tokens per row the kernel takes (more: prefill, SDPA's job)
SPLIT_SLOTS = 256  # a cache of more slots is split in chunks of at least this many
BLOCK_N = 64  # slots per block on the GPU
STAGE_BYTES = 128 * 1024  # shared memory for the k / v blocks in flight (H100/H200: 227 KB)
LOG2E = 1.4426950408889634


def decode_attention_on(q: torch.Tensor) -> bool:
    """Whether the model's cache path should call `decode_attention` for queries q [B, T, Hq, D]:
    Triton runs for q (kernels.dispatch.use_triton), T <= MAX_TOKENS, a float dtype, and the
    switch LEANTUNE_DECODE_ATTENTION is not "0"."""
    return (os.environ.get("LEANTUNE_DECODE_ATTENTION", "1") != "0" and use_triton(q)
            and q.shape[1] <= MAX_TOKENS
            and q.dtype in (torch.float32, torch.float16, torch.bfloat16))


def decode_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               pad: torch.Tensor, start: torch.Tensor, window: int | None,
                               scale: float) -> torch.Tensor:
    """Dense: the allowed slots of each query from the rule above, scores [B, Hq, T, S] and
    softmax in fp32, then the weights (in v's dtype) times v. -> [B, T, Hq, D] in q's dtype."""
    B, T, Hq, D = q.shape
    S, Hk = k_cache.shape[1], k_cache.shape[2]
    slot = torch.arange(S, device=q.device)
    back = (start.view(1) + torch.arange(T, device=q.device))[:, None] - slot  # [T, S]: i - j
    near = back >= 0 if window is None else (back >= 0) & (back < window)
    allowed = (back == 0) | (near & (slot >= pad.view(B, 1, 1)))  # [B, T, S]
    k = k_cache.float().repeat_interleave(Hq // Hk, dim=2)
    v = v_cache.repeat_interleave(Hq // Hk, dim=2)
    scores = torch.einsum("bthd,bshd->bhts", q.float(), k) * scale
    probs = torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhts,bshd->bthd", probs.to(v.dtype), v).to(q.dtype)


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _dot(a, b, F32_DOT: tl.constexpr):
        """a @ b, fp32 accumulation; F32_DOT: in IEEE fp32 (fp32 inputs, and the interpreter,
        whose bf16 tl.dot is wrong: exact either way, bf16 products are exact in fp32)."""
        if F32_DOT:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _attend_chunk(Q, K, V, PAD, START, b, kh, T, s_from, s_to, WINDOW, scale_log2,
                      sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
                      REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
                      F32_DOT: tl.constexpr):
        """Online softmax of kv head kh's rep * T query rows of row b over the live slots within
        [s_from, s_to). -> (acc [BLOCK_M, BLOCK_D] unnormalised, m [BLOCK_M] (log2 units),
        l [BLOCK_M]); rows m = t * REP + r are query head kh * REP + r of token t."""
        mrow = tl.arange(0, BLOCK_M)
        t = mrow // REP
        head = kh * REP + mrow % REP
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        live_row = mrow < REP * T
        q = tl.load(Q + b * sq_b + t[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                    mask=live_row[:, None] & dmask[None, :], other=0.0)
        start = tl.load(START).to(tl.int32)
        pad = tl.load(PAD + b).to(tl.int32)
        qslot = start + t  # [BLOCK_M]
        lo = pad
        if HAS_WINDOW:
            lo = tl.maximum(lo, start - WINDOW + 1)
        lo = tl.minimum(lo, start)  # a padding query's own slot
        lo = tl.maximum(lo, s_from)
        hi = tl.minimum(start + T, s_to)  # exclusive: nothing after the newest token is read
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for n0 in range((lo // BLOCK_N) * BLOCK_N, hi, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            nmask = (n >= lo) & (n < hi)
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(K + b * sk_b + n[:, None] * sk_s + kh * sk_h + d[None, :],
                        mask=kv_mask, other=0.0)
            v = tl.load(V + b * sv_b + n[:, None] * sv_s + kh * sv_h + d[None, :],
                        mask=kv_mask, other=0.0)  # (issued with k's: both loads in flight)
            s = _dot(q, tl.trans(k), F32_DOT) * scale_log2
            back = qslot[:, None] - n[None, :]  # i - j
            ok = (back >= 0) & (n[None, :] >= pad)
            if HAS_WINDOW:
                ok = ok & (back < WINDOW)
            ok = (ok | (back == 0)) & nmask[None, :]
            s = tl.where(ok, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # no -inf - -inf
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _store_out(O, acc, b, kh, T, so_b, so_t, so_h, REP: tl.constexpr, D: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """out[b, t, kh * REP + r, :] = acc[t * REP + r, :] (normalised rows)."""
        mrow = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        ptr = (O + b * so_b + (mrow // REP)[:, None] * so_t + (kh * REP + mrow % REP)[:, None]
               * so_h + d[None, :])
        tl.store(ptr, acc.to(O.dtype.element_ty),
                 mask=(mrow < REP * T)[:, None] & (d < D)[None, :])

    @triton.jit
    def _decode_attention_kernel(Q, K, V, O, OP, MP, LP, PAD, START, Hk, T, S, CHUNK, WINDOW,
                                 scale_log2, sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s,
                                 sv_h, so_b, so_t, so_h,
                                 REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                                 BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                                 HAS_WINDOW: tl.constexpr, SPLIT: tl.constexpr,
                                 F32_DOT: tl.constexpr):
        """Program (b * Hk + kh, chunk). Without SPLIT (one chunk): the normalised output into
        O. With SPLIT: partial acc into OP [B * Hk, splits, BLOCK_M, BLOCK_D] and its max and
        sum into MP / LP [B * Hk, splits, BLOCK_M] (fp32), for _merge_chunks_kernel."""
        bh = tl.program_id(0)
        chunk = tl.program_id(1)
        b = (bh // Hk).to(tl.int64)  # (b * stride: past 2^31 in large caches)
        kh = bh % Hk
        acc, m_i, l_i = _attend_chunk(
            Q, K, V, PAD, START, b, kh, T, chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, S),
            WINDOW, scale_log2, sq_b, sq_t, sq_h, sk_b, sk_s, sk_h, sv_b, sv_s, sv_h,
            REP, D, BLOCK_M, BLOCK_N, BLOCK_D, HAS_WINDOW, F32_DOT)
        if SPLIT:
            mrow = tl.arange(0, BLOCK_M)
            d = tl.arange(0, BLOCK_D)
            part = bh * tl.num_programs(1) + chunk
            tl.store(OP + (part * BLOCK_M + mrow[:, None]) * BLOCK_D + d[None, :], acc)
            tl.store(MP + part * BLOCK_M + mrow, m_i)
            tl.store(LP + part * BLOCK_M + mrow, l_i)
        else:  # the own slot is always seen: l_i > 0 on every live row
            l_i = tl.where(l_i == 0.0, 1.0, l_i)
            _store_out(O, acc / l_i[:, None], b, kh, T, so_b, so_t, so_h,
                       REP, D, BLOCK_M, BLOCK_D)

    @triton.jit
    def _merge_chunks_kernel(O, OP, MP, LP, Hk, T, SPLITS, so_b, so_t, so_h,
                             REP: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_D: tl.constexpr):
        """Program b * Hk + kh: out = sum_c 2^(m_c - m) acc_c / sum_c 2^(m_c - m) l_c."""
        bh = tl.program_id(0)
        mrow = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for c in range(0, SPLITS):
            part = bh * SPLITS + c
            m_c = tl.load(MP + part * BLOCK_M + mrow)
            m_new = tl.maximum(m_i, m_c)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            beta = tl.exp2(m_c - m_safe)
            o_c = tl.load(OP + (part * BLOCK_M + mrow[:, None]) * BLOCK_D + d[None, :])
            acc = acc * alpha[:, None] + o_c * beta[:, None]
            l_i = l_i * alpha + tl.load(LP + part * BLOCK_M + mrow) * beta
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        _store_out(O, acc / l_i[:, None], (bh // Hk).to(tl.int64), bh % Hk, T, so_b, so_t, so_h,
                   REP, D, BLOCK_M, BLOCK_D)


def split_count(batch: int, kv_heads: int, slots: int, device: torch.device) -> int:
    """Chunks of the cache's slots (a function of the static shapes only): 1 up to SPLIT_SLOTS
    slots, else enough for about one program per multiprocessor, each at least SPLIT_SLOTS."""
    if slots <= SPLIT_SLOTS:
        return 1
    return max(1, min(sm_count(device) // (batch * kv_heads), slots // SPLIT_SLOTS))


def _launch(q, k, v, pad, start, window, scale, splits, block_n) -> torch.Tensor:
    B, T, Hq, D = q.shape
    S, Hk = k.shape[1], k.shape[2]
    rep = Hq // Hk
    out = torch.empty(B, T, Hq, D, dtype=q.dtype, device=q.device)
    block_m = max(16, triton.next_power_of_2(rep * T))
    block_d = max(16, triton.next_power_of_2(D))
    block_n = block_n or (BLOCK_N if q.is_cuda else 16)  # (tl.dot: blocks of >= 16)
    per = -(-S // (splits or split_count(B, Hk, S, q.device)))
    chunk = -(-per // block_n) * block_n  # slots per chunk, whole blocks
    splits = -(-S // chunk)
    if splits > 1:  # partials: fixed shapes for fixed (B, Hk, S), so a CUDA graph can hold them
        o_part = torch.empty(B * Hk, splits, block_m, block_d, dtype=torch.float32,
                             device=q.device)
        m_part = torch.empty(B * Hk, splits, block_m, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
    else:
        o_part = m_part = l_part = out  # unused
    warps = 4 if block_m * block_d <= 64 * 128 else 8
    stage = 2 * block_n * block_d * k.element_size()  # a k and a v block in shared memory
    stages = max(1, min(3, STAGE_BYTES // stage))  # blocks in flight (3 at D 128 in bf16)
    _decode_attention_kernel[(B * Hk, splits)](
        q, k, v, out, o_part, m_part, l_part, pad, start, Hk, T, S, chunk, window or 0,
        scale * LOG2E, q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
        k.stride(2), v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1),
        out.stride(2), REP=rep, D=D, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        HAS_WINDOW=window is not None, SPLIT=splits > 1,
        F32_DOT=q.dtype == torch.float32 or not q.is_cuda, num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge_chunks_kernel[(B * Hk,)](
            out, o_part, m_part, l_part, Hk, T, splits, out.stride(0), out.stride(1),
            out.stride(2), REP=rep, D=D, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=warps)
    return out


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     pad: torch.Tensor, start: torch.Tensor, window: int | None, scale: float,
                     splits: int | None = None, block_n: int | None = None) -> torch.Tensor:
    """q [B, T, Hq, D] (the new tokens at slots start .. start + T - 1; any strides over B, T,
    H), k_cache / v_cache [B, S, Hk, D] (the whole buffers), pad [B] long (left padding per
    row), start [1] long (on the device), window (None: full attention), scale -> [B, T, Hq, D].
    `splits` / `block_n` (tests): force the chunk count and block size; None chooses."""
    B, T, Hq, D = q.shape
    if k_cache.shape[0] != B or k_cache.shape[3] != D or Hq % k_cache.shape[2]:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} does not fit the cache "
                         f"{tuple(k_cache.shape)} (same rows and head_dim, Hq a multiple of Hk)")
    if not use_triton(q):
        return decode_attention_reference(q, k_cache, v_cache, pad, start, window, scale)
    q, k_cache, v_cache = (t if t.stride(-1) == 1 else t.contiguous()
                           for t in (q, k_cache, v_cache))
    return _launch(q, k_cache, v_cache, pad, start, window, float(scale), splits, block_n)


__all__ = ["decode_attention", "decode_attention_reference", "decode_attention_on",
           "split_count", "MAX_TOKENS"]
