"""Weight-only FP8 GEMV / skinny GEMM for decoding (Triton): y = resid + x W^T for few rows.

    x      [M, in]   bf16 / fp16 / fp32, M <= GEMV_MAX_ROWS (the decode batch), NOT quantised
    W      [out, in] e4m3 codes with 128 x 128 block scales [ceil(out/128), ceil(in/128)] fp32
                     (kernels/fp8.py: FP8Weight, or an FP8View of stacked projections)
    y      [M, out]  in x.dtype (or `out`'s), fp32 accumulation

At M = 1 the GEMM of kernels/fp8_gemm.py pads the rows to a 16-row tile and quantises x; here
each program instead streams a BLOCK_N x K strip of codes (1 byte a weight: the copy bound),
dequantises them in registers (code * its block's scale; exact in fp32) and multiplies by the
unquantised x, so the result is the fp32 product x @ dequantize(W)^T up to the order of sums
(more accurate than the GEMM path, which also rounds x to e4m3). Two inner loops, picked per
shape by timing (below):

    "fma": M = 1. acc [BLOCK_N, BLOCK_K] += codes * (x * scale)[None, :]; one row sum at the end
           ("fma_rows": acc [BLOCK_N] += that row sum each step: fewer registers, more shuffles).
    "dot": M <= 16. tl.dot(x [16, BLOCK_K], codes [BLOCK_K, BLOCK_N]) with the codes cast to
           x's dtype (e4m3 is exact in bf16 / fp16 / fp32; fp32 x: an IEEE fp32 dot), times the
           tile's one scale (BLOCK_K and BLOCK_N divide 128: one scale block a tile). (The
           Triton interpreter's bf16 tl.dot is wrong: on the CPU the dot runs in fp32.)

Split-K: with SPLIT_K > 1 the programs of one strip take K / SPLIT_K each and write fp32
partials [SPLIT_K, M, out], which a second small kernel sums (adding resid, casting). Enough
programs in flight keep HBM busy for the 8B shapes (1024-28672 rows x 4096 / 14336).

Tuning: on the GPU the config is chosen per (M == 1, out, in, dtypes, resid) on first use by
timing each candidate as a CUDA graph of calls over rotating copies of the codes (cold L2, no
host launch overhead: what a captured decode step sees). That first call must come before a
CUDA graph capture (leantune.generate's DecodeStep runs two eager warm-up steps first); a call
during a capture that finds no tuned config uses a fixed heuristic one and tunes nothing.
LEANTUNE_FP8_TUNE=0 always uses the heuristic.

Routing (kernels/fp8.py fp8_mm): LEANTUNE_FP8_GEMV=0 off; =1 on wherever the Triton kernels run
(the interpreter included: the tests); default: on for CUDA tensors with <= 16 rows.
"""

from __future__ import annotations

import math
import os
import time
from typing import NamedTuple

import torch

from .fp8 import BLOCK

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (the emulation only)
    triton = None

GEMV_MAX_ROWS = 16  # rows up to which fp8_mm takes the GEMV (one 16-row dot tile)


def gemv_applies(x: torch.Tensor) -> bool:
    """Whether fp8_mm's forward for input x [n, in] takes the GEMV (module docstring: routing);
    the caller has checked that the Triton kernels run and FP8 is not emulated."""
    mode = os.environ.get("LEANTUNE_FP8_GEMV", "auto")
    if mode == "0" or x.dim() != 2 or not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        return False
    return mode == "1" or x.is_cuda


def fp8_gemv_reference(x: torch.Tensor, w, resid: torch.Tensor | None = None) -> torch.Tensor:
    """The plain-PyTorch math: resid + x @ dequantize(W)^T in fp32, in x.dtype. x [M, in]; w an
    FP8Weight / FP8View [out, in]; resid [M, out]."""
    y = x.float() @ w.dequantize(dtype=torch.float32).t()
    if resid is not None:
        y = y + resid.float()
    return y.to(x.dtype)


class GemvConfig(NamedTuple):
    """One launch shape: loop "fma" / "fma_rows" (M = 1) or "dot" (M <= 16); BLOCK_N output
    rows and BLOCK_K inputs a step (BLOCK_N divides 128; "dot": BLOCK_K too); split_k programs
    per strip."""
    loop: str
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


if triton is not None:

    @triton.jit
    def _fp8_gemv_kernel(X, W, S, Y, R, M, N, K, K_SPLIT,
                         stride_xm, stride_xk, stride_wn, stride_wk, stride_sn, stride_sk,
                         stride_ys, stride_ym, stride_yn, stride_rm, stride_rn,
                         HAS_R: tl.constexpr, DOT: tl.constexpr, ROW_SUM: tl.constexpr,
                         F32_DOT: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Y[pid_k] [M, N] = (R +) X[:, k range] W[:, k range]^T for program (pid_n, pid_k):
        rows pid_n * BLOCK_N + [0, BLOCK_N) of W, inputs [pid_k * K_SPLIT, + K_SPLIT) (module
        docstring). Y with stride_ys = 0 is the output itself (one split)."""
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = rn < N
        rn64 = rn.to(tl.int64)
        s_row = S + ((pid_n * BLOCK_N) // 128) * stride_sn  # BLOCK_N divides 128
        k_lo = pid_k * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, K)
        if DOT:
            rm = tl.arange(0, BLOCK_M)
            mask_m = rm < M
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        else:
            if ROW_SUM:
                acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            else:
                acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < k_hi
            w = tl.load(W + rn64[:, None] * stride_wn + rk[None, :] * stride_wk,
                        mask=mask_n[:, None] & mask_k[None, :], other=0.0)
            if DOT:  # the tile lies in one 128 x 128 scale block
                s = tl.load(s_row + (k0 // 128) * stride_sk)
                x = tl.load(X + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                            mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                if F32_DOT:
                    part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)),
                                  input_precision="ieee")
                else:
                    part = tl.dot(x, tl.trans(w.to(x.dtype)))
                acc += part * s
            else:
                s = tl.load(s_row + (rk // 128) * stride_sk, mask=mask_k, other=0.0)
                x = tl.load(X + rk * stride_xk, mask=mask_k, other=0.0).to(tl.float32)
                if ROW_SUM:
                    acc1 += tl.sum(w.to(tl.float32) * (x * s)[None, :], axis=1)
                else:
                    acc2 += w.to(tl.float32) * (x * s)[None, :]
        Y += pid_k * stride_ys
        if DOT:
            mask = mask_m[:, None] & mask_n[None, :]
            if HAS_R:
                acc += tl.load(R + rm[:, None] * stride_rm + rn64[None, :] * stride_rn,
                               mask=mask, other=0.0).to(tl.float32)
            tl.store(Y + rm[:, None] * stride_ym + rn64[None, :] * stride_yn,
                     acc.to(Y.dtype.element_ty), mask=mask)
        else:
            if ROW_SUM:
                y = acc1
            else:
                y = tl.sum(acc2, axis=1)
            if HAS_R:
                y += tl.load(R + rn64 * stride_rn, mask=mask_n, other=0.0).to(tl.float32)
            tl.store(Y + rn64 * stride_yn, y.to(Y.dtype.element_ty), mask=mask_n)

    @triton.jit
    def _split_sum_kernel(P, Y, R, MN, N, SPLIT, stride_ym, stride_yn, stride_rm, stride_rn,
                          HAS_R: tl.constexpr, BLOCK: tl.constexpr):
        """Y [M, N] = (R +) sum over SPLIT of the fp32 partials P [SPLIT, M, N] (contiguous)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < MN
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, SPLIT):
            acc += tl.load(P + s * MN + offs, mask=mask, other=0.0)
        m, n = offs // N, offs % N
        if HAS_R:
            acc += tl.load(R + m * stride_rm + n * stride_rn, mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + m * stride_ym + n * stride_yn, acc.to(Y.dtype.element_ty), mask=mask)


def _k_split(K: int, split: int) -> int:
    """Inputs per split: a multiple of 128 (whole scale blocks, whole "dot" tiles)."""
    return -(-K // (split * BLOCK)) * BLOCK


def _launch(x, w, out, resid, cfg: GemvConfig) -> torch.Tensor:
    M, K = x.shape
    N = w.shape[0]
    if cfg.loop != "dot" and M != 1:
        raise ValueError(f"fp8_gemv: the fma loop takes one row, got {M}")
    k_split = _k_split(K, cfg.split_k)
    splits = -(-K // k_split)
    target = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32,
                                                 device=x.device)
    ts = (0, out.stride(0), out.stride(1)) if splits == 1 else (M * N, N, 1)
    has_r = resid is not None and splits == 1
    r = resid if has_r else target
    rs = (r.stride(0), r.stride(1)) if has_r else (0, 0)
    grid = (triton.cdiv(N, cfg.block_n), splits)
    _fp8_gemv_kernel[grid](
        x, w.data, w.scale, target, r, M, N, K, k_split,
        x.stride(0), x.stride(1), w.data.stride(0), w.data.stride(1),
        w.scale.stride(0), w.scale.stride(1), *ts, *rs,
        HAS_R=has_r, DOT=cfg.loop == "dot", ROW_SUM=cfg.loop == "fma_rows",
        F32_DOT=x.dtype == torch.float32 or not x.is_cuda,
        BLOCK_M=16 if cfg.loop == "dot" else 1, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if splits > 1:
        r = resid if resid is not None else out
        sum_block = 1024
        _split_sum_kernel[(triton.cdiv(M * N, sum_block),)](
            target, out, r, M * N, N, splits, out.stride(0), out.stride(1), r.stride(0),
            r.stride(1), HAS_R=resid is not None, BLOCK=sum_block)
    return out


def fp8_gemv(x: torch.Tensor, w, out: torch.Tensor | None = None,
             resid: torch.Tensor | None = None, config: GemvConfig | None = None) -> torch.Tensor:
    """resid + x W^T (module docstring): x [M, in] (M <= 16), w an FP8Weight / FP8View [out, in],
    resid [M, out] (may be `out` itself); into `out` (any strides) when given, else a new
    [M, out] tensor in x.dtype. `config`: a fixed launch shape (tests, the bench), else the
    tuned one."""
    out_f, in_f = w.shape
    if x.dim() != 2 or x.shape[1] != in_f or not 1 <= x.shape[0] <= GEMV_MAX_ROWS:
        raise ValueError(f"fp8_gemv: input of shape {tuple(x.shape)} for a weight {w.shape}: "
                         f"needs [1..{GEMV_MAX_ROWS}, {in_f}]")
    out = out if out is not None else torch.empty(x.shape[0], out_f, dtype=x.dtype,
                                                  device=x.device)
    return _launch(x, w, out, resid, config or config_for(x, w, out, resid))


# ------------------------------------------------------------------------------------------------
# choosing the config
# ------------------------------------------------------------------------------------------------
def candidates(M: int, N: int, K: int, sms: int) -> list[GemvConfig]:
    """Launch shapes worth timing for M rows against [N, K]: splits that give between ~1 and
    ~8 programs a multiprocessor, each split at least 512 inputs long."""
    tiles = [("dot", bn, 128, w, st) for bn, w, st in  # (cp.async-pipelined: stages count)
             ((16, 4, 4), (32, 4, 4), (64, 4, 4), (64, 4, 6), (128, 4, 4), (128, 8, 3))]
    if M == 1:  # (plain vector loads: no stages)
        tiles += [("fma", bn, bk, w, 1) for bn, bk, w in
                  ((8, 512, 4), (16, 128, 4), (16, 256, 4), (32, 256, 4), (64, 128, 4),
                   (16, 512, 4), (64, 256, 8))]
        tiles += [("fma_rows", bn, bk, w, 1) for bn, bk, w in  # (narrow strips: many programs
                  ((4, 1024, 4), (8, 512, 4), (16, 256, 4), (32, 256, 4), (16, 512, 4),
                   (32, 512, 8), (64, 256, 8))]  # without a split)
    out = []
    for loop, bn, bk, warps, stages in tiles:
        strips = -(-N // bn)
        for split in (1, 2, 4, 8):
            if split == 1 or (K >= 512 * split and strips * split <= 8 * sms):
                out.append(GemvConfig(loop, bn, bk, split, warps, stages))
    return out


def heuristic(M: int, N: int, K: int, sms: int) -> GemvConfig:
    """The untuned config: split-K until there is a program a multiprocessor (or the splits
    would be short)."""
    loop, bn, bk = ("fma", 32, 256) if M == 1 else ("dot", 64, 128)
    strips = -(-N // bn)
    split = 1
    while strips * split < sms and K >= 1024 * split and split < 8:
        split *= 2
    return GemvConfig(loop, bn, bk, split)


_TUNED: dict[tuple, GemvConfig] = {}


def config_for(x, w, out, resid) -> GemvConfig:
    """The launch shape for this call: tuned on first use on the GPU (module docstring)."""
    from .dispatch import sm_count

    M, K = x.shape
    N = w.shape[0]
    sms = sm_count(x.device)
    if not x.is_cuda:  # the interpreter: small tiles, a split, fast
        return GemvConfig("fma" if M == 1 else "dot", 16, 128 if M > 1 else 64,
                          2 if K > 128 else 1)
    key = (M == 1, N, K, x.dtype, out.dtype, resid is not None, x.device)
    if key in _TUNED:
        return _TUNED[key]
    if (os.environ.get("LEANTUNE_FP8_TUNE", "1") == "0"
            or torch.cuda.is_current_stream_capturing()):
        return heuristic(M, N, K, sms)
    _TUNED[key] = tune(x, w, out.dtype, resid, candidates(M, N, K, sms))
    return _TUNED[key]


def tune(x, w, out_dtype, resid, configs: list[GemvConfig]) -> GemvConfig:
    """The fastest of `configs` for this call (graph_time_us over rotating copies of the codes;
    scratch outputs: the caller's `out` and `resid` are not written)."""
    from .fp8 import FP8View

    copies = rotating_copies(w.data)
    scratch = torch.empty(x.shape[0], w.shape[0], dtype=out_dtype, device=x.device)
    best, best_us = None, math.inf
    for cfg in configs:
        calls = [lambda c=c, cfg=cfg: _launch(x, c, scratch, resid, cfg)
                 for c in (FP8View(d, w.scale, w.dtype) for d in copies)]
        try:
            us = graph_time_us(calls, x.device)
        except Exception:  # a config this GPU cannot compile or run (resources)
            continue
        if us < best_us:
            best, best_us = cfg, us
    if best is None:
        raise RuntimeError("fp8_gemv: no launch config ran on this GPU")
    return best


def rotating_copies(t: torch.Tensor, min_bytes: int = 256 << 20,
                    most: int = 32) -> list[torch.Tensor]:
    """t and copies of its shape (uninitialised: timing does not read values), together at
    least min_bytes where memory allows, so that timed calls cycling through them miss L2 as
    decoding's (each weight read once a token) do. Off CUDA: t alone."""
    if t.device.type != "cuda":
        return [t]
    n = max(1, min(most, -(-min_bytes // max(1, t.numel() * t.element_size()))))
    copies = [t]
    try:
        copies += [torch.empty_like(t) for _ in range(n - 1)]
    except torch.OutOfMemoryError:
        pass
    return copies


def graph_time_us(calls, device: torch.device, reps: int = 32, trials: int = 5) -> float:
    """Microseconds per call of the zero-argument `calls` (cycled; e.g. one per weight copy):
    on CUDA `reps` calls captured as one CUDA graph, the best of `trials` replays (what a
    captured decode step pays, with no host launch cost); on the CPU the host clock."""
    calls = calls[:reps]
    for c in calls:  # compile / tune / load the modules outside the capture
        c()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for c in calls:
            c()
        return 1e6 * (time.perf_counter() - t0) / len(calls)
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    best = math.inf
    for _ in range(trials):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, 1e3 * start.elapsed_time(end) / reps)
    del graph
    return best


__all__ = ["GEMV_MAX_ROWS", "GemvConfig", "candidates", "config_for", "fp8_gemv",
           "fp8_gemv_reference", "gemv_applies", "graph_time_us", "heuristic",
           "rotating_copies", "tune"]
