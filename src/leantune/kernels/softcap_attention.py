"""Soft-capped causal attention (Gemma 2) as flash-style Triton kernels, forward and backward.

Gemma 2 caps every score before the softmax: s = scale * q.k, cap(s) = c * tanh(s / c). Per
query t of row b, the keys it sees are j with

    start[b, t] <= j <= t   and   t - j < window        (the query itself included)

start [B, T] int32 being where t's document begins in its row (None: 0, one document a row).
Shapes: q [B, T, Hq, D], k/v [B, T, Hk, D] (GQA: q head h reads k/v head h // (Hq / Hk)),
out [B, T, Hq, D] in q's dtype, lse [B, Hq, T] fp32 (the log-sum-exp of the capped scores, as
flash attention keeps it).

Forward (one program per block of BLOCK_M queries and q head): an online softmax over the key
blocks the queries can see (from max(start of the first query, first query - window + 1) up to
the last query); blocks outside that range are never loaded.

Backward, from dout, out and lse (p recomputed, no [T, T] tensor kept):

    p = exp(cap(s) - lse),  dv = p^T do,  dp = do v^T,  delta = rowsum(do * out),
    ds = p (dp - delta) (1 - tanh^2(s / c)),  dq = scale ds k,  dk = scale ds^T q

in two deterministic kernels (no atomics): dk/dv, one program per block of BLOCK_N keys and
k/v head, loops over the q heads of that k/v head and the query blocks that see the keys (up to
the end of the keys' document, end [B, T] int32, and the window); dq, one program per block of
queries and q head, loops over the same key blocks as the forward. delta is one torch reduction.
Blocks of keys that every query of the block sees (inside the causal, document and window
bounds) can run in a loop of their own without the mask (`split` in the configs below).

softcap_attention_fwd / _bwd are autograd-free (the engine keeps lse itself); SoftcapAttention
is the autograd.Function over them (the plain model under autograd). `supports` says which
inputs the kernels take; `softcap_attention_reference` is the same math with the whole [T, T]
scores (tests, small T). Under TRITON_INTERPRET=1 (the tests) the kernels run on the CPU with
16 x 16 blocks. model/softcap_attention.py chooses between them and its PyTorch query blocks.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (reference path only)
    triton = None

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernels take these inputs: one dtype, D <= 256, offsets within a row below
    2^31 (int32 in the kernels); fp32 only off CUDA (the interpreter: the tests), as fp32 dots
    run without tensor cores."""
    T = q.shape[1]
    return (q.dtype == k.dtype == v.dtype and q.dtype in SUPPORTED_DTYPES and q.shape[-1] <= 256
            and not (q.is_cuda and q.dtype == torch.float32)
            and all(T * t.stride(1) + t.shape[2] * t.stride(2) < 2**31 for t in (q, k, v)))


def visible_keys(start: torch.Tensor | None, B: int, T: int, window: int | None,
                 device) -> torch.Tensor:
    """bool [B, 1, T, T]: key j visible to query t (module docstring)."""
    qp = torch.arange(T, device=device)[:, None]
    kp = torch.arange(T, device=device)[None, :]
    m = (kp <= qp)[None].expand(B, T, T)
    if window is not None:
        m = m & (qp - kp < window)
    if start is not None:
        m = m & (kp[None] >= start[:, :, None].long())
    return m[:, None]


def softcap_attention_reference(q, k, v, window: int | None, scale: float, softcap: float,
                                start: torch.Tensor | None = None):
    """The whole [B, Hq, T, T] scores in fp32 (differentiable) -> (out [B, T, Hq, D] in q's
    dtype, lse [B, Hq, T] fp32)."""
    B, T, Hq, D = q.shape
    rep = Hq // k.shape[2]
    kf = k.float().repeat_interleave(rep, dim=2)
    vf = v.float().repeat_interleave(rep, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), kf) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~visible_keys(start, B, T, window, q.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", torch.exp(s - lse[..., None]), vf)
    return out.to(q.dtype), lse


# ------------------------------------------------------------------------------------------------
# Triton kernels
# ------------------------------------------------------------------------------------------------
if triton is not None:

    from .triton_math import tanh

    @triton.jit
    def _dot(a, b, F32_DOT: tl.constexpr):
        """a @ b with fp32 accumulation (fp32 inputs: IEEE, not TF32)."""
        if F32_DOT:
            return tl.dot(a, b, input_precision="ieee")
        return tl.dot(a, b)

    @triton.jit
    def _visible(qp, kp, qlo):
        """bool (broadcast of qp, kp): key position kp visible to query position qp, whose
        first visible key is qlo. (Rows past T: their outputs are never stored; in dk/dv
        their lse is +inf, so p = 0.)"""
        return (kp <= qp) & (kp >= qlo)

    @triton.jit
    def _query_rows(P, START, b, t0, T, window, stride_t, rd, D, BLOCK_M: tl.constexpr,
                    HAS_DOCS: tl.constexpr):
        """Positions [BLOCK_M], pointers [BLOCK_M, BLOCK_D] (P: row b and head applied), load
        mask and first visible keys [BLOCK_M] (document start, window) of the queries t0.."""
        rm = t0 + tl.arange(0, BLOCK_M)
        mask = (rm < T)[:, None] & (rd < D)[None, :]
        if HAS_DOCS:
            qstart = tl.load(START + b * T + rm, mask=rm < T, other=0)
        else:
            qstart = tl.zeros([BLOCK_M], dtype=tl.int32)
        qlo = tl.maximum(qstart, rm - window + 1)
        return rm, P + rm[:, None] * stride_t + rd[None, :], mask, qlo

    @triton.jit
    def _key_range(START, b, t0, T, window, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   HAS_DOCS: tl.constexpr):
        """[lo, hi): the key blocks (lo a multiple of BLOCK_N) the queries t0.. can see."""
        lo = tl.maximum(t0 - window + 1, 0)
        if HAS_DOCS:
            lo = tl.maximum(lo, tl.load(START + b * T + t0))  # starts grow along the row
        return (lo // BLOCK_N) * BLOCK_N, tl.minimum(t0 + BLOCK_M, T)

    @triton.jit
    def _split(lo, hi, full_lo, full_hi):
        """(a, b): [lo, a) and [b, hi) need the mask, [a, b) does not, for the mask-free blocks
        [full_lo, full_hi) (block multiples; block loops step from lo, a and b)."""
        a = tl.minimum(tl.maximum(full_lo, lo), hi)
        return a, tl.minimum(tl.maximum(full_hi, a), hi)

    @triton.jit
    def _part(part: tl.constexpr, lo, a, b, hi, SPLIT: tl.constexpr):
        """The block range of loop `part` of (lo, a, b, hi) (_split): [lo, a), [a, b), [b, hi);
        without SPLIT one loop, [lo, hi)."""
        if not SPLIT:
            return lo, hi
        if part == 0:
            return lo, a
        if part == 1:
            return a, b
        return b, hi

    @triton.jit
    def _query_program(Q, K, V, START, T, Hq, rep, window, sq_b, sq_t, sq_h, sk_b, sk_h, sv_b,
                       sv_h, D, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr):
        """A query-block program (grid: query blocks, B * Hq): its row b (int64), q head h,
        columns, positions, load mask, first visible keys and q tile, the k/v bases of its k/v
        head, and the key blocks it sees: [lo, a) and [b, hi) masked, [a, b) all visible to
        all its queries (keys <= its first query, from the largest first visible key)."""
        t0 = tl.program_id(0) * BLOCK_M
        b64 = (tl.program_id(1) // Hq).to(tl.int64)
        h = tl.program_id(1) % Hq
        rd = tl.arange(0, BLOCK_D)
        rm, pq, mq, qlo = _query_rows(Q + b64 * sq_b + h * sq_h, START, b64, t0, T, window,
                                      sq_t, rd, D, BLOCK_M, HAS_DOCS)
        q = tl.load(pq, mask=mq, other=0.0)
        Kb = K + b64 * sk_b + (h // rep) * sk_h
        Vb = V + b64 * sv_b + (h // rep) * sv_h
        lo, hi = _key_range(START, b64, t0, T, window, BLOCK_M, BLOCK_N, HAS_DOCS)
        full_lo = tl.cdiv(tl.max(qlo, axis=0), BLOCK_N) * BLOCK_N
        a, b = _split(lo, hi, full_lo, ((t0 + 1) // BLOCK_N) * BLOCK_N)
        return b64, h, rd, rm, mq, qlo, q, Kb, Vb, lo, a, b, hi

    @triton.jit
    def _kv_tile(Kb, Vb, s0, T, sk_t, sv_t, rd, D, BLOCK_N: tl.constexpr):
        """Positions, load mask and k, v tiles [BLOCK_N, BLOCK_D] of the keys s0.. (Kb, Vb: row
        and head applied)."""
        rn = s0 + tl.arange(0, BLOCK_N)
        mk = (rn < T)[:, None] & (rd < D)[None, :]
        k = tl.load(Kb + rn[:, None] * sk_t + rd[None, :], mask=mk, other=0.0)
        v = tl.load(Vb + rn[:, None] * sv_t + rd[None, :], mask=mk, other=0.0)
        return rn, mk, k, v

    @triton.jit
    def _grad_rows(DO, LSE, DELTA, b64, h, rm, rd, mq, T, Hq, sd_b, sd_t, sd_h):
        """dout tile [BLOCK_M, BLOCK_D], lse and delta [BLOCK_M] of queries rm, q head h."""
        do = tl.load(DO + b64 * sd_b + h * sd_h + rm[:, None] * sd_t + rd[None, :], mask=mq,
                     other=0.0)
        lse = tl.load(LSE + (b64 * Hq + h) * T + rm, mask=rm < T, other=float("inf"))
        delta = tl.load(DELTA + (b64 * T + rm) * Hq + h, mask=rm < T, other=0.0)
        return do, lse, delta

    @triton.jit
    def _fwd_blocks(acc, m_i, l_i, lo, hi, q, Kb, Vb, rm, qlo, rd, T, sk_t, sv_t, scale_c,
                    softcap, D, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
                    MASK: tl.constexpr):
        """The online softmax over the key blocks [lo, hi) (MASK: with the visibility mask)."""
        for s0 in range(lo, hi, BLOCK_N):
            rn, mk, k, v = _kv_tile(Kb, Vb, s0, T, sk_t, sv_t, rd, D, BLOCK_N)
            cap = tanh(_dot(q, tl.trans(k), F32_DOT) * scale_c) * softcap
            if MASK:
                cap = tl.where(_visible(rm[:, None], rn[None, :], qlo[:, None]), cap,
                               float("-inf"))
            m_new = tl.maximum(m_i, tl.max(cap, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with no key yet
            p = tl.exp(cap - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, F32_DOT)
            m_i = m_new
        return acc, m_i, l_i

    @triton.jit
    def _fwd_kernel(Q, K, V, O, LSE, START, T, Hq, rep, window, scale_c, softcap,
                    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr, F32_DOT: tl.constexpr,
                    SPLIT: tl.constexpr):
        """One program: BLOCK_M queries of q head h in row b; online softmax over key blocks."""
        b64, h, rd, rm, mq, qlo, q, Kb, Vb, lo, a, b, hi = _query_program(
            Q, K, V, START, T, Hq, rep, window, sq_b, sq_t, sq_h, sk_b, sk_h, sv_b, sv_h,
            D, BLOCK_D, BLOCK_M, BLOCK_N, HAS_DOCS)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for part in tl.static_range(3 if SPLIT else 1):  # masked, mask-free, masked
            p_lo, p_hi = _part(part, lo, a, b, hi, SPLIT)
            acc, m_i, l_i = _fwd_blocks(acc, m_i, l_i, p_lo, p_hi, q, Kb, Vb, rm, qlo, rd, T,
                                        sk_t, sv_t, scale_c, softcap, D, BLOCK_N, F32_DOT,
                                        part != 1)
        l_i = tl.where(l_i == 0.0, 1.0, l_i)  # rows past T only (every query sees itself)
        po = O + b64 * so_b + h * so_h + rm[:, None] * so_t + rd[None, :]
        tl.store(po, (acc / l_i[:, None]).to(O.dtype.element_ty), mask=mq)
        tl.store(LSE + (b64 * Hq + h) * T + rm, m_i + tl.log(l_i), mask=rm < T)

    @triton.jit
    def _dq_blocks(dq, lo, hi, q, do, lse, delta, Kb, Vb, rm, qlo, rd, T, sk_t, sv_t, scale_c,
                   softcap, D, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr,
                   MASK: tl.constexpr):
        """dq += the key blocks [lo, hi)' share (MASK: with the visibility mask)."""
        for s0 in range(lo, hi, BLOCK_N):
            rn, mk, k, v = _kv_tile(Kb, Vb, s0, T, sk_t, sv_t, rd, D, BLOCK_N)
            th = tanh(_dot(q, tl.trans(k), F32_DOT) * scale_c)
            p = tl.exp(th * softcap - lse[:, None])
            if MASK:
                p = tl.where(_visible(rm[:, None], rn[None, :], qlo[:, None]), p, 0.0)
            dp = _dot(do, tl.trans(v), F32_DOT)
            ds = p * (dp - delta[:, None]) * (1.0 - th * th)
            dq += _dot(ds.to(k.dtype), k, F32_DOT)
        return dq

    @triton.jit
    def _dq_kernel(Q, K, V, DO, LSE, DELTA, DQ, START, T, Hq, rep, window, scale_c, softcap,
                   scale, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h,
                   sd_b, sd_t, sd_h, sdq_b, sdq_t, sdq_h,
                   D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr, F32_DOT: tl.constexpr,
                   SPLIT: tl.constexpr):
        """One program: dq of BLOCK_M queries of q head h in row b, over the forward's keys."""
        b64, h, rd, rm, mq, qlo, q, Kb, Vb, lo, a, b, hi = _query_program(
            Q, K, V, START, T, Hq, rep, window, sq_b, sq_t, sq_h, sk_b, sk_h, sv_b, sv_h,
            D, BLOCK_D, BLOCK_M, BLOCK_N, HAS_DOCS)
        do, lse, delta = _grad_rows(DO, LSE, DELTA, b64, h, rm, rd, mq, T, Hq, sd_b, sd_t, sd_h)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        for part in tl.static_range(3 if SPLIT else 1):  # masked, mask-free, masked
            p_lo, p_hi = _part(part, lo, a, b, hi, SPLIT)
            dq = _dq_blocks(dq, p_lo, p_hi, q, do, lse, delta, Kb, Vb, rm, qlo, rd, T, sk_t,
                            sv_t, scale_c, softcap, D, BLOCK_N, F32_DOT, part != 1)
        pdq = DQ + b64 * sdq_b + h * sdq_h + rm[:, None] * sdq_t + rd[None, :]
        tl.store(pdq, (dq * scale).to(DQ.dtype.element_ty), mask=mq)

    @triton.jit
    def _dkdv_blocks(dk, dv, lo, hi, k, v, Qh, DO, LSE, DELTA, START, b64, h, rn, rd, T, Hq,
                     window, scale_c, softcap, sq_t, sd_b, sd_t, sd_h, D,
                     BLOCK_M: tl.constexpr, HAS_DOCS: tl.constexpr, F32_DOT: tl.constexpr,
                     MASK: tl.constexpr):
        """dk, dv += the query blocks [lo, hi)' share, q head h (Qh: its row and head
        applied; MASK: with the visibility mask). Tiles are transposed: [keys, queries]."""
        for t0 in range(lo, hi, BLOCK_M):
            rm, pq, mq, qlo = _query_rows(Qh, START, b64, t0, T, window, sq_t, rd, D, BLOCK_M,
                                          HAS_DOCS)
            q = tl.load(pq, mask=mq, other=0.0)
            do, lse, delta = _grad_rows(DO, LSE, DELTA, b64, h, rm, rd, mq, T, Hq, sd_b, sd_t,
                                        sd_h)
            th = tanh(_dot(k, tl.trans(q), F32_DOT) * scale_c)  # [BLOCK_N, BLOCK_M]
            p = tl.exp(th * softcap - lse[None, :])
            if MASK:
                p = tl.where(_visible(rm[None, :], rn[:, None], qlo[None, :]), p, 0.0)
            dv += _dot(p.to(do.dtype), do, F32_DOT)
            dp = _dot(v, tl.trans(do), F32_DOT)
            ds = p * (dp - delta[None, :]) * (1.0 - th * th)
            dk += _dot(ds.to(q.dtype), q, F32_DOT)
        return dk, dv

    @triton.jit
    def _dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, START, END, T, Hq, Hk, rep, window,
                     scale_c, softcap, scale, sq_b, sq_t, sq_h, sk_b, sk_t, sk_h,
                     sv_b, sv_t, sv_h, sd_b, sd_t, sd_h, sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
                     D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr, F32_DOT: tl.constexpr,
                     SPLIT: tl.constexpr):
        """One program: dk, dv of BLOCK_N keys of k/v head hk in row b, summed over its rep q
        heads and the query blocks that see the keys (transposed tiles: [keys, queries])."""
        s0 = tl.program_id(0) * BLOCK_N
        b = tl.program_id(1) // Hk
        hk = tl.program_id(1) % Hk
        b64 = b.to(tl.int64)
        rd = tl.arange(0, BLOCK_D)
        rn, mk, k, v = _kv_tile(K + b64 * sk_b + hk * sk_h, V + b64 * sv_b + hk * sv_h, s0, T,
                                sk_t, sv_t, rd, D, BLOCK_N)
        last = tl.minimum(s0 + BLOCK_N, T) - 1
        hi = tl.minimum(T, last + window)  # queries t < last + window
        if HAS_DOCS:
            hi = tl.minimum(hi, tl.load(END + b64 * T + last))  # ends grow along the row
        lo = (s0 // BLOCK_M) * BLOCK_M
        # all keys visible to the queries t0.. of [a, b): t0 >= the last key, t < s0 + window
        # and t < the end of s0's document, for every t of the block
        full_hi = tl.minimum(T, s0 + window)
        if HAS_DOCS:
            full_hi = tl.minimum(full_hi, tl.load(END + b64 * T + s0))
        a, b = _split(lo, hi, tl.cdiv(s0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M,
                      (full_hi // BLOCK_M) * BLOCK_M)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        for r in range(0, rep):
            h = hk * rep + r
            for part in tl.static_range(3 if SPLIT else 1):  # masked, mask-free, masked
                p_lo, p_hi = _part(part, lo, a, b, hi, SPLIT)
                dk, dv = _dkdv_blocks(dk, dv, p_lo, p_hi, k, v, Q + b64 * sq_b + h * sq_h, DO,
                                      LSE, DELTA, START, b64, h, rn, rd, T, Hq, window,
                                      scale_c, softcap, sq_t, sd_b, sd_t, sd_h, D, BLOCK_M,
                                      HAS_DOCS, F32_DOT, part != 1)
        pdk = DK + b64 * sdk_b + hk * sdk_h + rn[:, None] * sdk_t + rd[None, :]
        tl.store(pdk, (dk * scale).to(DK.dtype.element_ty), mask=mk)
        pdv = DV + b64 * sdv_b + hk * sdv_h + rn[:, None] * sdv_t + rd[None, :]
        tl.store(pdv, dv.to(DV.dtype.element_ty), mask=mk)


# (BLOCK_M queries, BLOCK_N keys, num_warps, num_stages, split) of each kernel by head size
# (the smallest key >= D); 16 x 16 blocks in the interpreter. split 1: the blocks all of whose
# keys all the block's queries see run in a loop of their own, without the mask (more code,
# more registers: off for dk/dv, where it spills). Untuned starting points for an H200: large
# tiles whose sm_90 build (bf16, 16-byte aligned strides) spills no registers;
# bench/gpu_softcap.py --sweep times others. The environment variables LEANTUNE_SOFTCAP_FWD,
# _DKDV, _DQ = "m,n[,warps[,stages[,split]]]" override them (tests, sweeps). fp32 inputs take
# IEEE fp32 dots (no tensor cores): right, not fast (the model keeps its PyTorch blocks for
# them on CUDA).
_CONFIGS = {
    "fwd": {64: (128, 64, 4, 2, 1), 128: (128, 64, 8, 2, 1), 256: (64, 64, 8, 2, 1)},
    "dkdv": {64: (32, 64, 4, 2, 0), 128: (32, 64, 8, 2, 0), 256: (64, 32, 8, 2, 0)},
    "dq": {64: (64, 32, 4, 2, 1), 128: (128, 32, 8, 2, 1), 256: (64, 32, 8, 2, 1)},
}
_INTERPRET = (16, 16, 1, 1, 1)


def _config(kernel: str, d: int, device):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, split) of `kernel` ("fwd", "dkdv", "dq")
    for head size d (above)."""
    if device.type != "cuda":
        cfg = _INTERPRET
    else:
        table = _CONFIGS[kernel]
        cfg = table[min((key for key in table if key >= d), default=256)]
    env = os.environ.get(f"LEANTUNE_SOFTCAP_{kernel.upper()}")
    if env:
        given = tuple(int(x) for x in env.split(","))
        cfg = given + cfg[len(given):]
    return cfg


def _block_d(d: int) -> int:
    return max(16, triton.next_power_of_2(d))  # tl.dot's least


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _common(q, k, window, start):
    B, T, Hq, D = q.shape
    Hk = k.shape[2]
    if Hq % Hk:
        raise ValueError(f"softcap attention: {Hq} q heads are not a multiple of {Hk} k/v heads")
    w = T if window is None else max(1, min(int(window), T))
    has_docs = start is not None
    start = start.to(torch.int32).contiguous() if has_docs else q.new_zeros(1, dtype=torch.int32)
    return B, T, Hq, Hk, D, w, has_docs, start


def softcap_attention_fwd(q, k, v, window: int | None, scale: float, softcap: float,
                          start: torch.Tensor | None = None):
    """q [B, T, Hq, D], k/v [B, T, Hk, D], start [B, T] int (None: one document a row) ->
    (out [B, T, Hq, D] in q's dtype, lse [B, Hq, T] fp32). No autograd."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, T, Hq, Hk, D, w, has_docs, start = _common(q, k, window, start)
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    if B * T == 0:
        return out, lse
    bm, bn, warps, stages, split = _config("fwd", D, q.device)
    _fwd_kernel[(triton.cdiv(T, bm), B * Hq)](
        q, k, v, out, lse, start, T, Hq, Hq // Hk, w, float(scale / softcap), float(softcap),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
        D=D, BLOCK_D=_block_d(D), BLOCK_M=bm, BLOCK_N=bn, HAS_DOCS=has_docs,
        F32_DOT=q.dtype == torch.float32, SPLIT=bool(split), num_warps=warps,
        num_stages=stages)
    return out, lse


def softcap_attention_bwd(dout, q, k, v, out, lse, window: int | None, scale: float,
                          softcap: float, start: torch.Tensor | None = None,
                          end: torch.Tensor | None = None):
    """(dq, dk, dv) like q, k, v from dout [B, T, Hq, D] and the forward's out and lse
    [B, Hq, T]; start/end [B, T] int: where each token's document begins / ends (exclusive) in
    its row (both None: one document a row). No autograd."""
    q, k, v, dout = _unit_last(q), _unit_last(k), _unit_last(v), _unit_last(dout)
    B, T, Hq, Hk, D, w, has_docs, start = _common(q, k, window, start)
    end = end.to(torch.int32).contiguous() if has_docs else start
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if B * T == 0:
        return dq, dk, dv
    delta = (dout.float() * out.float()).sum(-1).contiguous()  # [B, T, Hq]
    lse = lse.float().contiguous()
    consts = dict(D=D, BLOCK_D=_block_d(D), HAS_DOCS=has_docs,
                  F32_DOT=q.dtype == torch.float32)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), dout.stride(0), dout.stride(1),
               dout.stride(2))
    bm, bn, warps, stages, split = _config("dkdv", D, q.device)
    _dkdv_kernel[(triton.cdiv(T, bn), B * Hk)](
        q, k, v, dout, lse, delta, dk, dv, start, end, T, Hq, Hk, Hq // Hk, w,
        float(scale / softcap), float(softcap), float(scale), *strides,
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, SPLIT=bool(split), num_warps=warps, num_stages=stages,
        **consts)
    bm, bn, warps, stages, split = _config("dq", D, q.device)
    _dq_kernel[(triton.cdiv(T, bm), B * Hq)](
        q, k, v, dout, lse, delta, dq, start, T, Hq, Hq // Hk, w, float(scale / softcap),
        float(softcap), float(scale), *strides, dq.stride(0), dq.stride(1), dq.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, SPLIT=bool(split), num_warps=warps, num_stages=stages,
        **consts)
    return dq, dk, dv


class SoftcapAttention(torch.autograd.Function):
    """The kernels under autograd: (q, k, v) -> (out, lse), lse not differentiable; for
    callers that run attention under autograd (the plain model), the engine calls the
    autograd-free entry points above."""

    @staticmethod
    def forward(ctx, q, k, v, window, scale, softcap, start, end):
        out, lse = softcap_attention_fwd(q, k, v, window, scale, softcap, start)
        ctx.save_for_backward(q, k, v, out, lse, start, end)
        ctx.args = (window, scale, softcap)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, k, v, out, lse, start, end = ctx.saved_tensors
        grads = softcap_attention_bwd(dout, q, k, v, out, lse, *ctx.args, start, end)
        return (*grads, None, None, None, None, None)
