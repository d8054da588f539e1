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

On Hopper the GEMMs run on cuBLAS instead where torch has its blockwise scaled matmul (the
section "the cuBLAS path" below: the activation quantised by one Triton pass of
kernels/fp8_quant.py into the layout cuBLAS reads, dX through the transposed codes); a probe per
device decides, LEANTUNE_FP8_GEMM=auto|triton|cublas switches, and the Triton kernel runs
wherever cuBLAS does not (few rows, odd shapes, other GPUs). A forward GEMM's input may come
already quantised, as a kernels/fp8_quant.QuantizedRows written by the kernel that produced it
(the fused layers' RMSNorm and GLU: takes_quantized says where; LEANTUNE_FP8_FUSED_QUANT=0
switches it off): then no quantisation pass runs.

Under TRITON_INTERPRET=1 (the tests) the interpreter runs the kernel on the CPU, e4m3 included;
the cuBLAS path's glue is tested there with the scaled mm emulated (emulate_scaled_mm).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from .fp8 import BLOCK, FP8_DTYPE, FP8Weight
from .fp8_quant import (ROW_ALIGN, QuantizedRows, plain, quantize_rows, quantize_rows_reference,
                        transpose_codes_, transpose_codes_reference)

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
    def _fp8_gemm_kernel(A, SA, B, SB, C, R, M, N, K, M_KEY,
                         stride_am, stride_ak, stride_sa, stride_bk, stride_bn, stride_sk,
                         stride_sn, stride_cm, stride_cn, stride_rm, stride_rn,
                         HAS_R: tl.constexpr, A_CODES: tl.constexpr, ROUND_FP32: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr):
        """C[M, N] = R + A[M, K] B[K, N] (module docstring); B e4m3 with block scales SB
        [ceil(K / 128), ceil(N / 128)]; BLOCK_K = 128 (one scale block a step). A_CODES: A is
        already e4m3 codes with scales SA [ceil(K / 128), M] (row stride stride_sa;
        kernels/fp8_quant.quantize_rows), else 16/32-bit, quantised here per tile. M_KEY: M
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
            if A_CODES:  # (quantised once for every N tile: no amax and cast per tile)
                qa = tl.load(A + rm[:, None] * stride_am + rk[None, :] * stride_ak,
                             mask=mask_m[:, None] & mask_k[None, :], other=0.0)
                sa = tl.load(SA + (k0 // BLOCK_K) * stride_sa + rm, mask=mask_m, other=0.0)
            else:
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

    _fp8_gemm_tuned = triton.autotune(_CUDA_CONFIGS,
                                      key=["M_KEY", "N", "K", "HAS_R", "A_CODES"],
                                      prune_configs_by={"early_config_prune": _prune},
                                      restore_value=["C"])(_fp8_gemm_kernel)


# Where the Triton kernel quantises the activation: "kernel" (per tile, inside the GEMM: each
# of the N / BLOCK_N tiles of a row redoes its amax and cast), "pass" (once, by
# kernels/fp8_quant.quantize_rows, and the GEMM reads e4m3 codes), "auto" (a pass from
# PREQUANT_MIN_ROWS rows: training; decoding's few rows quantise in the kernel, one launch)
ACT_QUANTS = ("auto", "kernel", "pass")
_act_quant = os.environ.get("LEANTUNE_FP8_ACT_QUANT", "auto")
PREQUANT_MIN_ROWS = 64


def set_act_quant(name: str) -> None:
    """Where the Triton GEMM quantises its activation (ACT_QUANTS; LEANTUNE_FP8_ACT_QUANT)."""
    global _act_quant
    if name not in ACT_QUANTS:
        raise ValueError(f"LEANTUNE_FP8_ACT_QUANT / set_act_quant must be one of {ACT_QUANTS}, "
                         f"got {name!r}")
    _act_quant = name


def prequantizes(M: int) -> bool:
    """Whether the Triton GEMM of M rows reads codes quantised by one pass (set_act_quant)."""
    if _act_quant not in ACT_QUANTS:
        raise ValueError(f"LEANTUNE_FP8_ACT_QUANT={_act_quant!r}: use one of "
                         f"{', '.join(ACT_QUANTS)}")
    return _act_quant == "pass" or (_act_quant == "auto" and M >= PREQUANT_MIN_ROWS)


def transposes(device: torch.device) -> bool:
    """Whether dX GEMMs on `device` read the weight through a transposed scratch copy: where
    the Triton kernel runs with the dX layout "transpose", and wherever the cuBLAS path may
    run (it always reads the codes transposed)."""
    from .dispatch import use_triton
    from .fp8 import emulating

    device = torch.device(device)
    if emulating() or not use_triton(torch.empty(0, device=device)):
        return False
    return _dx_layout == "transpose" or cublas_reason(device) is None


# the interpreter's tiles: small (fast tests, several programs); LEANTUNE_FP8_TUNE=0 uses them
# on the GPU too, as 128 x 128 (no autotuning)
_FIXED_TILES = dict(BLOCK_M=32, BLOCK_N=64, GROUP_M=2)
_GPU_TILES = dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8, num_stages=3)


def transpose_codes(w: FP8Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """W's codes transposed, [in, out] contiguous, into `out` (a scratch buffer) when given:
    the Triton tiled transpose where the kernels run (kernels/fp8_quant.py), else torch's copy
    (between e4m3 tensors: through their bytes, which every backend copies)."""
    from .dispatch import use_triton

    if use_triton(w.data) and w.data.is_contiguous():
        return transpose_codes_(w.data, out)
    return transpose_codes_reference(w.data, out)


def fp8_gemm(x: torch.Tensor, w: FP8Weight, transpose: bool = False,
             out: torch.Tensor | None = None, resid: torch.Tensor | None = None,
             scratch: torch.Tensor | None = None) -> torch.Tensor:
    """resid + x W^T (x [M, in]; transpose=False) or resid + x W (x [M, out]; transpose=True)
    in x.dtype, into `out` when given (any strides); `scratch`: a [in, out] e4m3 buffer for the
    transposed codes (dx_layout "transpose", and the cuBLAS path). On CUDA the cuBLAS path runs
    where uses_cublas says so, else the Triton kernel. x may be a QuantizedRows (its codes
    read where the GEMM reads codes: no quantisation pass)."""
    xq, x = x, plain(x)
    out_f, in_f = w.shape
    K, N = (out_f, in_f) if transpose else (in_f, out_f)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"fp8_gemm: input of shape {tuple(x.shape)} for a weight {w.shape} "
                         f"({'dX' if transpose else 'forward'}: K = {K})")
    M = x.shape[0]
    if x.is_cuda:
        y = try_cublas(xq, w, transpose, out, resid, scratch)
        if y is not None:
            return y
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
    codes = prequantizes(M)
    if not codes:
        a, sa = x, x
    elif isinstance(xq, QuantizedRows):  # (rows past M are masked off: padding unread)
        a, sa = xq.codes, xq.scale_t
    else:
        a, sa = quantize_rows(x)
    args = (a, sa, b, s, out, r, M, N, K, triton.next_power_of_2(M), a.stride(0), a.stride(1),
            sa.stride(0), *strides_b, *strides_s,
            out.stride(0), out.stride(1), r.stride(0), r.stride(1))

    def grid(meta):
        return (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)

    flags = dict(HAS_R=resid is not None, A_CODES=codes, ROUND_FP32=not x.is_cuda,
                 BLOCK_K=BLOCK)
    if not x.is_cuda:
        _fp8_gemm_kernel[grid](*args, **flags, **_FIXED_TILES)
    elif os.environ.get("LEANTUNE_FP8_TUNE", "1") == "0":
        _fp8_gemm_kernel[grid](*args, **flags, **_GPU_TILES)
    else:
        _fp8_gemm_tuned[grid](*args, **flags)
    return out


# ------------------------------------------------------------------------------------------------
# the cuBLAS path: torch's blockwise scaled matmul (DeepSeek-style scales, Hopper)
# ------------------------------------------------------------------------------------------------
# Torch (built with cuBLASLt >= 12.9) runs e4m3 GEMMs with 1 x 128 activation scales and
# 128 x 128 weight scales through cuBLASLt on sm_90 (aten/src/ATen/native/cuda/ScaledBlas.cpp,
# _scaled_block1x128_block128x128 / _check_deepseek_support; other archs are refused):
# torch._scaled_mm since 2.9 (pytorch#158037), torch.nn.functional.scaled_mm since 2.10
# (pytorch#164142), the L4 padding below enforced since pytorch#166752 (before it, unpadded
# 128 x 128 scales gave wrong results silently: the probe checks K/128 = 3).
# For C [M, N] = A [M, K] B [K, N]:
#   A  e4m3 row-major;                     scale_a fp32 [M, K/128], strides (1, M)
#   B  e4m3 column-major (B^T contiguous);  scale_b fp32 [L4, N/128], strides (1, L4),
#                                           L4 = K/128 rounded up to a multiple of 4
# with decoding scales (C = sum_kb sa * sb * A_kb B_kb), K and N multiples of 16. The public
# entry torch.nn.functional.scaled_mm (ScalingType.BlockWise1x128 / BlockWise128x128,
# SwizzleType.NO_SWIZZLE) checks exactly these layouts; the older torch._scaled_mm infers the
# recipe from the scales' shapes and strides and takes the same tensors where K/128 is a
# multiple of 4 (no padding), writing into `out=`. Hopper's cuBLASLt reads row-major A and
# column-major B only, so:
#   forward Y = X W^T:  A = X's codes, B = W^T (W [out, in] contiguous is B column-major),
#                       scale_b = W's scales [out/128, in/128] transposed
#   dX = dY W:          A = dY's codes, B = W: its codes transposed into the scratch buffer
#                       [in, out] (transpose_codes), scale_b = W's scales as stored.
# The activation's codes and scales come from kernels/fp8_quant.quantize_rows (one Triton pass,
# the scales written block-major so that scale_t.t() has the strides above). There is no
# residual input: resid is added after the GEMM (one pass over the output).
GEMM_PATHS = ("auto", "triton", "cublas")
_gemm_path = os.environ.get("LEANTUNE_FP8_GEMM", "auto")
CUBLAS_MIN_ROWS = 64  # fewer rows (decoding) take the Triton kernel's weight-streaming tiles
_OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def set_gemm_path(name: str) -> None:
    """Which GEMM runs the FP8 products on CUDA (LEANTUNE_FP8_GEMM): "auto" (cuBLAS where the
    probe passes and the shape fits, else Triton), "triton", or "cublas" (an error where the
    probe fails; shapes it cannot take still run the Triton kernel)."""
    global _gemm_path
    if name not in GEMM_PATHS:
        raise ValueError(f"LEANTUNE_FP8_GEMM / set_gemm_path must be one of {GEMM_PATHS}, "
                         f"got {name!r}")
    _gemm_path = name


def gemm_path() -> str:
    return _gemm_path


@contextlib.contextmanager
def using_gemm_path(name: str):
    """set_gemm_path(name) for a block, the previous path restored after it."""
    old = _gemm_path
    set_gemm_path(name)
    try:
        yield
    finally:
        set_gemm_path(old)


def _round4(n: int) -> int:
    return -(-n // 4) * 4


def weight_scales_for_cublas(scale_nk: torch.Tensor) -> torch.Tensor:
    """B's 128 x 128 scales in its [N, K] orientation, [N/128, K/128] (any strides) -> the
    scale_b cuBLAS reads: [L4, N/128] with strides (1, L4), zero-padded past K/128 (a view of
    scale_nk itself where it is contiguous and K/128 a multiple of 4: the forward's usual
    case, no copy)."""
    nb, kb = scale_nk.shape
    l4 = _round4(kb)
    if l4 == kb and scale_nk.is_contiguous():
        return scale_nk.t()
    padded = scale_nk.new_zeros(nb, l4)
    padded[:, :kb] = scale_nk
    return padded.t()


def check_blockwise_operands(a, b, scale_a, scale_b) -> None:
    """The layouts torch's blockwise scaled mm takes (comment above), as one ValueError naming
    the operand: what emulate_scaled_mm checks, so a layout mistake in the glue fails on the
    CPU as it would on the GPU."""
    M, K = a.shape
    N = b.shape[1]
    kb, nb = -(-K // BLOCK), -(-N // BLOCK)
    l4 = _round4(kb)
    problems = []
    if a.dtype != FP8_DTYPE or b.dtype != FP8_DTYPE:
        problems.append(f"A and B must be e4m3 (got {a.dtype}, {b.dtype})")
    if b.shape[0] != K:
        problems.append(f"A [{M}, {K}] and B {tuple(b.shape)} do not chain")
    if a.stride(1) != 1 or a.stride(0) < K:  # (torch: row-major, column-major)
        problems.append(f"A must be row-major (strides {a.stride()})")
    if b.stride(0) != 1 or b.stride(1) < K:
        problems.append(f"B must be column-major (strides {b.stride()})")
    if K % 16 or N % 16:
        problems.append(f"K ({K}) and N ({N}) must be multiples of 16")

    def ok(t, shape, strides):
        return (t.dtype == torch.float32 and tuple(t.shape) == shape
                and all(n <= 1 or st == want for n, st, want in zip(t.shape, t.stride(), strides)))

    if not ok(scale_a, (M, kb), (1, M)):
        problems.append(f"scale_a must be fp32 [{M}, {kb}] with strides (1, {M}) (got "
                        f"{scale_a.dtype} {tuple(scale_a.shape)} strides {scale_a.stride()})")
    if not ok(scale_b, (l4, nb), (1, l4)):
        problems.append(f"scale_b must be fp32 [{l4}, {nb}] with strides (1, {l4}) (got "
                        f"{scale_b.dtype} {tuple(scale_b.shape)} strides {scale_b.stride()})")
    if problems:
        raise ValueError("blockwise scaled mm (1x128 x 128x128): " + "; ".join(problems))


def emulate_scaled_mm(a, b, scale_a, scale_b, out_dtype, out=None) -> torch.Tensor:
    """torch's blockwise scaled mm in fp32 on exactly the tensors the cuBLAS call gets (codes,
    scales, layouts: checked as torch checks them): C = (A * sa) (B * sb), each scale over its
    1 x 128 / 128 x 128 block; into `out` when given."""
    check_blockwise_operands(a, b, scale_a, scale_b)
    M, K = a.shape
    N = b.shape[1]
    kb = -(-K // BLOCK)
    sa = scale_a.repeat_interleave(BLOCK, 1)[:, :K]
    sb = scale_b[:kb].repeat_interleave(BLOCK, 0)[:K].repeat_interleave(BLOCK, 1)[:, :N]
    y = ((a.float() * sa) @ (b.float() * sb)).to(out_dtype)
    return y if out is None else out.copy_(y)


@functools.lru_cache(maxsize=None)
def _dtype_keyword() -> str:
    """The name of F.scaled_mm's output dtype argument in this torch (output_dtype in 2.13)."""
    import inspect

    import torch.nn.functional as F

    params = inspect.signature(F.scaled_mm).parameters
    return "output_dtype" if "output_dtype" in params else "out_dtype"


def _scaled_mm_v2(a, b, scale_a, scale_b, out_dtype, out=None):
    """torch.nn.functional.scaled_mm with the recipes named (torch 2.10+; no swizzle)."""
    import torch.nn.functional as F

    y = F.scaled_mm(a, b, scale_a, F.ScalingType.BlockWise1x128, scale_b,
                    F.ScalingType.BlockWise128x128, **{_dtype_keyword(): out_dtype})
    return y if out is None else out.copy_(y)


def _scaled_mm_v1(a, b, scale_a, scale_b, out_dtype, out=None):
    """torch._scaled_mm (recipe inferred from the scales; K/128 a multiple of 4), into out."""
    if out is None:
        return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype)
    return torch._scaled_mm(a, b, scale_a, scale_b, out_dtype=out_dtype, out=out)


# the torch entry points, in the order tried: F.scaled_mm pads any K; _scaled_mm writes into out
SCALED_MM_APIS = {"F.scaled_mm": _scaled_mm_v2, "torch._scaled_mm": _scaled_mm_v1}
_probed: dict[int, dict[str, str | None]] = {}
# (N, K, dtype) -> why cuBLAS refused a GEMM of that shape ("auto" then runs it on Triton)
_refused: dict[tuple, str] = {}


def probe_cublas(device: torch.device) -> dict[str, str | None]:
    """Per torch entry point (SCALED_MM_APIS): None where a small blockwise GEMM on `device`
    runs and agrees with emulate_scaled_mm, else why not (one line). Run once per device and
    cached; never while a CUDA graph is being captured (then: every entry "capturing")."""
    device = torch.device(device)
    if device.type != "cuda":
        return {name: f"{device.type}: cuBLAS FP8 runs on CUDA devices" for name in SCALED_MM_APIS}
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx in _probed:
        return _probed[idx]
    if torch.cuda.is_current_stream_capturing():
        return {name: "capturing a CUDA graph: not probed" for name in SCALED_MM_APIS}
    result = {}
    cap = torch.cuda.get_device_capability(idx)
    g = torch.Generator(device=device).manual_seed(0)
    for name, fn in SCALED_MM_APIS.items():
        if cap[0] != 9:
            result[name] = (f"sm_{cap[0]}{cap[1]}: torch's blockwise (1x128, 128x128) scaled "
                            "mm runs on sm_90 (Hopper) only")
            continue
        # K = 512: 4 scale blocks; K = 384 (F.scaled_mm only): 3, padded to 4 (torch before
        # pytorch#166752 read unpadded 128 x 128 scales wrongly, silently); 100 rows: padded
        result[name] = probe_entry(fn, device, ((128, 256, 512), (100, 256, 384))
                                   [:2 if fn is _scaled_mm_v2 else 1], g)
    _probed[idx] = result
    return result


def probe_entry(fn, device, shapes, generator=None) -> str | None:
    """None where cublas_gemm through the entry point `fn` agrees with emulate_scaled_mm (rel
    err < 1e-2, bf16) at each (M, N, K) of `shapes` on `device`, else the first failure."""
    for M, N, K in shapes:
        try:
            x = torch.randn(M, K, device=device, generator=generator, dtype=torch.bfloat16)
            w = FP8Weight((N, K), torch.bfloat16, device=device).quantize_(
                torch.randn(N, K, device=device, generator=generator) * 0.02)
            y = cublas_gemm(x, w, scaled_mm=fn).float()
            ref = cublas_gemm(x, w, scaled_mm=emulate_scaled_mm).float()
            err = ((y - ref).norm() / ref.norm()).item()
        except Exception as e:  # (this torch lacks the entry point or the recipe)
            return f"K={K}: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if not err < 1e-2:
            return f"K={K}: disagrees with the emulation (rel {err:.2g})"
    return None


def cublas_reason(device: torch.device) -> str | None:
    """None where the cuBLAS path can run on `device` (LEANTUNE_FP8_GEMM is not "triton" and an
    entry point passed the probe), else why not."""
    if _gemm_path == "triton":
        return "LEANTUNE_FP8_GEMM=triton"
    status = probe_cublas(device)
    if any(v is None for v in status.values()):
        return None
    return "; ".join(f"{k}: {v}" for k, v in status.items())


def _scaled_mm_for(device: torch.device, kb: int):
    """The probed entry point for a GEMM of K/128 = kb: torch._scaled_mm where it passed and
    needs no scale padding (it writes into `out`), else F.scaled_mm; None where neither fits."""
    status = probe_cublas(device)
    if status.get("torch._scaled_mm", "") is None and kb % 4 == 0:
        return _scaled_mm_v1
    if status.get("F.scaled_mm", "") is None:
        return _scaled_mm_v2
    return None


def uses_cublas(x: torch.Tensor, M: int, N: int, K: int) -> bool:
    """Whether the GEMM of x [M, K] (CUDA) to N columns runs on cuBLAS: the path is not
    "triton", K and N are multiples of 128 (whole scale blocks), M >= CUBLAS_MIN_ROWS under
    "auto" (and no earlier GEMM of this N, K refused: _refused), an output dtype cuBLAS
    writes, and a probed entry point fits. "cublas" where the probe failed: a RuntimeError
    with the probe's reasons."""
    if _gemm_path not in GEMM_PATHS:
        raise ValueError(f"LEANTUNE_FP8_GEMM={_gemm_path!r}: use one of {', '.join(GEMM_PATHS)}")
    if _gemm_path == "triton" or K % BLOCK or N % BLOCK or x.dtype not in _OUT_DTYPES:
        return False
    if _gemm_path == "auto" and (M < CUBLAS_MIN_ROWS or (N, K, x.dtype) in _refused):
        return False
    reason = cublas_reason(x.device)
    if reason is not None:
        if _gemm_path == "cublas" and "capturing" not in reason:
            raise RuntimeError(f"LEANTUNE_FP8_GEMM=cublas, but cuBLAS FP8 does not run here: "
                               f"{reason}; use LEANTUNE_FP8_GEMM=auto or triton")
        return False
    return _scaled_mm_for(x.device, K // BLOCK) is not None


def try_cublas(x, w, transpose, out, resid, scratch) -> torch.Tensor | None:
    """fp8_gemm through cublas_gemm where uses_cublas says so, else None (the Triton kernel's
    turn). Under "auto" a GEMM cuBLASLt refuses (a shape the probe did not try) also returns
    None, and its (N, K, dtype) goes to _refused: later ones go to Triton directly."""
    out_f, in_f = w.shape
    K, N = (out_f, in_f) if transpose else (in_f, out_f)
    x16 = plain(x)
    if not uses_cublas(x16, x16.shape[0], N, K):
        return None
    try:
        return cublas_gemm(x, w, transpose=transpose, out=out, resid=resid, scratch=scratch)
    except RuntimeError as e:
        if _gemm_path == "cublas":
            raise
        _refused[(N, K, x16.dtype)] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        return None


def quantize_padded(x: torch.Tensor | QuantizedRows,
                    triton_kernel: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [Mp, K], scale_t [K / 128, Mp]), Mp = M rounded up to ROW_ALIGN, the
    rows past M zero codes with scale 1 (their products are dropped): kernels/fp8_quant's
    quantize_rows (triton_kernel) or its reference; a QuantizedRows' own (no pass at all)."""
    if isinstance(x, QuantizedRows):
        return x.codes, x.scale_t
    M, K = x.shape
    if triton_kernel and M % ROW_ALIGN == 0:
        return quantize_rows(x)
    q = QuantizedRows.empty(x)
    (quantize_rows if triton_kernel else quantize_rows_reference)(x, *q.targets)
    return q.codes, q.scale_t


def fused_quant() -> bool:
    """Whether the kernels that produce a cuBLAS FP8 GEMM's input quantise it as they write it
    (kernels/fp8_quant.QuantizedRows; the engine asks takes_quantized): on unless
    LEANTUNE_FP8_FUSED_QUANT=0 (then the GEMM's own quantize_rows pass, as before)."""
    return os.environ.get("LEANTUNE_FP8_FUSED_QUANT", "1") != "0"


def takes_quantized(x: torch.Tensor, N: int, K: int, switch: bool | None = None) -> bool:
    """Whether the GEMM of x [M, K] to N columns should be handed x pre-quantised (a
    QuantizedRows): its switch on (`switch`; by default fused_quant(), the forward inputs')
    and the GEMM on the cuBLAS path (uses_cublas), where it would otherwise run quantize_rows
    over x."""
    on = fused_quant() if switch is None else switch
    return on and x.shape[1] == K and uses_cublas(x, x.shape[0], N, K)


def cublas_gemm(x: torch.Tensor, w: FP8Weight, transpose: bool = False,
                out: torch.Tensor | None = None, resid: torch.Tensor | None = None,
                scratch: torch.Tensor | None = None, scaled_mm=None) -> torch.Tensor:
    """fp8_gemm's result through torch's blockwise scaled mm (section comment): x quantised by
    quantize_padded (the Triton kernel where the kernels run, else its reference), dX's codes
    transposed into `scratch`, resid added after. scaled_mm: the entry point (default: the
    probed one for this device); the CPU tests pass emulate_scaled_mm, which takes the same
    tensors. x may be a QuantizedRows: its codes are used as they are."""
    from .dispatch import use_triton

    xq, x = x, plain(x)
    out_f, in_f = w.shape
    K, N = (out_f, in_f) if transpose else (in_f, out_f)
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"cublas_gemm: input of shape {tuple(x.shape)} for a weight {w.shape} "
                         f"({'dX' if transpose else 'forward'}: K = {K})")
    codes, scale_t = quantize_padded(xq, use_triton(x))
    if transpose:  # B^T = W^T [in, out]: the codes transposed, their scales [in/128, out/128]
        bt, sb = transpose_codes(w, scratch), w.scale.t()
    else:  # B^T = W [out, in] as stored
        bt, sb = w.data, w.scale
    mm = scaled_mm or _scaled_mm_for(x.device, -(-K // BLOCK))
    if mm is None:
        raise RuntimeError(f"cublas_gemm: no torch blockwise scaled mm runs on {x.device} "
                           f"({cublas_reason(x.device)})")
    M = x.shape[0]
    # the product straight into `out` where cuBLAS can write it (contiguous, no padded rows)
    # and it holds no residual still to be read (another storage): no [M, N] temporary
    direct = (out is not None and out.dtype == x.dtype and out.is_contiguous()
              and codes.shape[0] == M
              and (resid is None or resid.untyped_storage().data_ptr()
                   != out.untyped_storage().data_ptr()))
    y = mm(codes, bt.t(), scale_t.t(), weight_scales_for_cublas(sb), x.dtype,
           out=out if direct else None)
    if direct:
        return out if resid is None else out.add_(resid)
    y = y[:M]
    if resid is not None:
        return y.add_(resid) if out is None else torch.add(resid, y, out=out)
    return y if out is None else out.copy_(y)


__all__ = ["ACT_QUANTS", "DX_LAYOUTS", "GEMM_PATHS", "SCALED_MM_APIS",
           "check_blockwise_operands", "cublas_gemm", "cublas_reason", "emulate_scaled_mm",
           "fp8_gemm", "fused_quant", "gemm_path", "prequantizes", "probe_cublas", "probe_entry",
           "quantize_padded", "set_act_quant", "set_dx_layout", "set_gemm_path",
           "takes_quantized", "transpose_codes", "try_cublas", "uses_cublas", "using_gemm_path",
           "weight_scales_for_cublas"]
