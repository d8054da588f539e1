"""The FP8 GEMM with the activation quantised inside it (Triton): C = R + A B, A the 16-bit
activation [M, K], B the frozen e4m3 weight in either orientation, fp32 accumulation.

Each program computes a BLOCK_M x BLOCK_N tile of C. Per 128-wide step along K it loads the
16-bit A tile, takes each row's amax over those 128 columns, scales and casts it to e4m3 in
registers (the 1 x 128 activation blocks of kernels/fp8.py; no separate amax pass over A in
memory), loads the e4m3 B tile and its 128 x 128 block scales, and adds
tl.dot(qa, qb) * sa[:, None] * sb[None, :] to the fp32 accumulator (the scales are applied
per K block, as the math of kernels/fp8.py's docstring says).

The two GEMMs of a frozen LoRA base read one stored weight W [out, in] (codes and scales):
    forward   Y  = X W^T:  B[k, n] = W[n, k]   (K = in; B is K-major: k contiguous)
    backward  dX = dY W:   B[k, n] = W[k, n]   (K = out)
The backward's B is N-major. Where the GPU's FP8 MMA wants K-major operands the Triton compiler
lays the tile out in shared memory; `dx_layout="transpose"` instead transposes W's codes into a
scratch buffer [in, out] first (one per GEMM, the caller's buffer when given: no second
resident copy) and runs the forward orientation: the default, as Hopper's FP8 wgmma reads
K-major operands only; LEANTUNE_FP8_DX=direct (or set_dx_layout) switches; bench/gpu_fp8.py
measures both. The engine's scratch buffers for it are shared by every layer
(engine/weights.ScratchPool) and allocated before memory is measured.

Under TRITON_INTERPRET=1 (the tests) the interpreter runs the kernel on the CPU, e4m3 included.
"""

from __future__ import annotations

import os

import torch

from .fp8 import BLOCK, FP8_MAX, FP8Weight

try:
    import triton
    import triton.language as tl

    from .fp8_quant import round_to_e4m3
except ImportError:  # the package works without Triton (the emulation only)
    triton = None

# "direct": dX reads W as it is stored; "transpose": through a transposed scratch copy
DX_LAYOUTS = ("direct", "transpose")
_dx_layout = os.environ.get("LEANTUNE_FP8_DX", "transpose")


def set_dx_layout(name: str) -> None:
    """How dX = dY W reads the weight (module docstring): "direct" or "transpose"."""
    global _dx_layout
    if name not in DX_LAYOUTS:
        raise ValueError(f"FP8 dX layout must be one of {DX_LAYOUTS}, got {name!r}")
    _dx_layout = name


if triton is not None:

    @triton.jit
    def _fp8_gemm_kernel(A, B, SB, C, R, M, N, K, M_KEY,
                         stride_am, stride_ak, stride_bk, stride_bn, stride_sk, stride_sn,
                         stride_cm, stride_cn, stride_rm, stride_rn,
                         HAS_R: tl.constexpr, ROUND_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """C[M, N] = R + A[M, K] B[K, N] (module docstring); B e4m3 with block scales SB
        [ceil(K / 128), ceil(N / 128)]; BLOCK_K = 128 (one scale block a step). M_KEY: M
        rounded up to a power of two, the autotuner's key (unused here), so that prompts of
        other lengths reuse one tuning."""
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BLOCK_M)
        num_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * num_n)  # grouped order: neighbours share B tiles in L2
        first_m = group * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
        pid_n = (pid % (GROUP_M * num_n)) // size_m
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        mask_m, mask_n = rm < M, rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            mask_k = rk < K
            a = tl.load(A + rm[:, None] * stride_am + rk[None, :] * stride_ak,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
            amax = tl.max(tl.abs(a), axis=1)
            sa = tl.where(amax > 0, amax / 448.0, 1.0)
            inv = tl.where(amax > 0, 448.0 / tl.where(amax > 0, amax, 1.0), 1.0)
            qa = tl.clamp(a * inv[:, None], -448.0, 448.0)
            if ROUND_FP32:
                qa = round_to_e4m3(qa)
            qa = qa.to(tl.float8e4nv)
            b = tl.load(B + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
                        mask=mask_k[:, None] & mask_n[None, :], other=0.0)
            sb = tl.load(SB + (k0 // BLOCK_K) * stride_sk + (rn // BLOCK_K) * stride_sn,
                         mask=mask_n, other=0.0)
            acc += tl.dot(qa, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        mask = mask_m[:, None] & mask_n[None, :]
        if HAS_R:
            acc += tl.load(R + rm[:, None] * stride_rm + rn[None, :] * stride_rn, mask=mask,
                           other=0.0).to(tl.float32)
        tl.store(C + rm[:, None] * stride_cm + rn[None, :] * stride_cn,
                 acc.to(C.dtype.element_ty), mask=mask)



if triton is not None:
    # On the GPU the tile shape is tuned per (M, N, K) on first use (C is restored after each
    # trial: it may hold the residual the kernel adds to).
    # Few rows (decoding: M = the batch) take the small-M tiles alone: the GEMM then streams
    # the e4m3 weight, half the bytes of bf16.
    _CUDA_CONFIGS = [triton.Config(dict(BLOCK_M=m, BLOCK_N=n, GROUP_M=8), num_warps=w,
                                   num_stages=st)
                     for m, n, w, st in ((128, 128, 8, 3), (128, 256, 8, 3), (128, 128, 4, 4),
                                         (64, 256, 8, 3), (256, 128, 8, 3), (64, 128, 4, 4),
                                         (16, 128, 4, 4), (16, 64, 4, 4), (32, 128, 4, 4))]

    def _prune(configs, named_args, **kwargs):
        """Tiles no taller than the rows need (at least 16, tl.dot's least)."""
        rows = max(16, named_args["M_KEY"])
        fit = [c for c in configs if c.kwargs["BLOCK_M"] <= rows]
        small = [c for c in fit if c.kwargs["BLOCK_M"] <= 32]
        return small if rows <= 32 else [c for c in fit if c.kwargs["BLOCK_M"] >= 64] or fit

    _fp8_gemm_tuned = triton.autotune(_CUDA_CONFIGS, key=["M_KEY", "N", "K", "HAS_R"],
                                      prune_configs_by={"early_config_prune": _prune},
                                      restore_value=["C"])(_fp8_gemm_kernel)


def transposes(device: torch.device) -> bool:
    """Whether dX GEMMs on `device` read the weight through a transposed scratch copy (the
    kernel runs there and the dX layout is "transpose")."""
    from .dispatch import use_triton
    from .fp8 import emulating

    return (_dx_layout == "transpose" and not emulating()
            and use_triton(torch.empty(0, device=device)))


# the interpreter's tiles: small (fast tests, several programs); LEANTUNE_FP8_TUNE=0 uses them
# on the GPU too, as 128 x 128 (no autotuning)
_FIXED_TILES = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2)
_GPU_TILES = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def transpose_codes(w: FP8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """W's codes transposed, [in, out] contiguous, into `out` (a scratch buffer) when given."""
    out = out if out is not None else torch.empty(w.shape[::-1], dtype=w.data.dtype,
                                                  device=w.device)
    # (copy_ between e4m3 tensors: through their bytes, which every backend copies)
    out.view(torch.uint8).copy_(w.data.view(torch.uint8).t())
    return out


def fp8_gemm(x: torch.Tensor, w: FP8Weight, transpose: bool = False,
             out: torch.Tensor | None = None, resid: torch.Tensor | None = None,
             scratch: torch.Tensor | None = None) -> torch.Tensor:
    """resid + x W^T (x [M, in]; transpose=False) or resid + x W (x [M, out]; transpose=True)
    in x.dtype, into `out` when given (any strides); `scratch`: a [in, out] e4m3 buffer for the
    transposed codes (dx_layout "transpose")."""
    out_f, in_f = w.shape
    K, N = (out_f, in_f) if transpose else (in_f, out_f)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"fp8_gemm: input of shape {tuple(x.shape)} for a weight {w.shape} "
                         f"({'dX' if transpose else 'forward'}: K = {K})")
    M = x.shape[0]
    out = out if out is not None else torch.empty(M, N, dtype=x.dtype, device=x.device)
    s = w.scale
    if not transpose:  # B[k, n] = W[n, k]
        b, sb = w.data, s
        strides_b = (b.stride(1), b.stride(0))
        strides_s = (sb.stride(1), sb.stride(0))
    elif _dx_layout == "transpose":  # the transposed codes, read K-major: B[k, n] = Wt[n, k]
        b = transpose_codes(w, scratch)
        strides_b = (b.stride(1), b.stride(0))
        strides_s = (s.stride(0), s.stride(1))
    else:  # B[k, n] = W[k, n]
        b = w.data
        strides_b = (b.stride(0), b.stride(1))
        strides_s = (s.stride(0), s.stride(1))
    r = resid if resid is not None else out
    args = (x, b, s, out, r, M, N, K, triton.next_power_of_2(M), x.stride(0), x.stride(1),
            *strides_b, *strides_s,
            out.stride(0), out.stride(1), r.stride(0), r.stride(1))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    flags = dict(HAS_R=resid is not None, ROUND_FP32=not x.is_cuda, BLOCK_K=BLOCK)
    if not x.is_cuda:
        _fp8_gemm_kernel[grid](*args, **flags, **_FIXED_TILES)
    elif os.environ.get("LEANTUNE_FP8_TUNE", "1") == "0":
        _fp8_gemm_kernel[grid](*args, **flags, **_GPU_TILES)
    else:
        _fp8_gemm_tuned[grid](*args, **flags)
    return out


__all__ = ["DX_LAYOUTS", "fp8_gemm", "set_dx_layout", "transpose_codes"]
