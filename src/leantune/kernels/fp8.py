"""FP8 (e4m3) base weights with 128 x 128 block scales: the container, the quantiser and the
plain-PyTorch emulation of the FP8 GEMMs (the reference; kernels/fp8_gemm.py has the Triton
kernel, which quantises the activation inside the GEMM).

A frozen weight W [out, in] is stored as

    data   float8_e4m3fn [out, in]                      q = round(W / s_block), |q| <= 448
    scale  fp32 [ceil(out / 128), ceil(in / 128)]       s_block = amax(|W| in the block) / 448
                                                          (1 for an all-zero block)

so W ~= q * s. A 128 x 128 block is a block of both GEMMs' reduction dimension: the forward
Y = X W^T reduces over `in`, the input gradient dX = dY W over `out`, and both read the same
codes and scales (no second, transposed copy is kept).

Activations are quantised per row and 128-column block of the GEMM's reduction dimension:
X [n, K] -> codes [n, K] and scales [n, ceil(K / 128)], s = amax / 448 per 1 x 128 block. The
GEMM is then, per output element,

    Y[i, j] = sum_kb  sx[i, kb] * sw[jb, kb] * sum_{k in kb} qx[i, k] * qw[j, k]

The emulation computes exactly the dequantised values' product in fp32 (each FP8 value and
scale is exact in fp32), so it differs from the kernel only in the order of fp32 sums.
Rounding: x * (448 / amax) in fp32, clamped to +-448, then round-to-nearest-even to e4m3
(torch's cast; the kernel's, kernels/fp8_gemm.py).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .nf4 import FormatBuffers

BLOCK = 128          # the block edge of weight scales, and the activation blocks' length
FP8_MAX = 448.0      # the largest finite e4m3 value
FP8_DTYPE = torch.float8_e4m3fn
_QUANT_ROWS = 128 * 8  # weight rows quantised at a time (bounds the fp32 temporaries)
MIN_CAPABILITY = (8, 9)  # FP8 matrix units: Ada (sm_89), Hopper (sm_90), Blackwell


def emulating() -> bool:
    """LEANTUNE_FP8_EMULATE=1: the FP8 GEMMs run as the PyTorch emulation on any device (the
    CPU reference path; slow, for tests and checks)."""
    return os.environ.get("LEANTUNE_FP8_EMULATE", "") == "1"


def fp8_unsupported(device: torch.device) -> str | None:
    """Why FP8 GEMMs cannot run on `device` (None when they can, or when emulating)."""
    if emulating():
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return (f"{device.type}: no FP8 matrix units; FP8 runs on CUDA GPUs of compute "
                "capability 8.9+ (Ada, Hopper, Blackwell), or emulated with "
                "LEANTUNE_FP8_EMULATE=1 (slow); use --precision bf16")
    cap = torch.cuda.get_device_capability(device)
    if cap < MIN_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} (sm_{cap[0]}{cap[1]}) has no FP8 matrix "
                "units (sm_89+: Ada, Hopper, Blackwell); use --precision bf16")
    from .dispatch import HAS_TRITON

    if not HAS_TRITON:
        return "the FP8 GEMM is a Triton kernel and Triton does not import; pip install triton"
    return None


def block_quantize(x: torch.Tensor, rows_per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [R, C] (any float dtype) -> (codes e4m3 [R, C], scales fp32 [ceil(R / rows_per_block),
    ceil(C / 128)]): one scale per rows_per_block x 128 block (1 for activations, 128 for
    weights), the block's amax / 448 (1 where the block is all zero)."""
    R, C = x.shape
    br = rows_per_block
    xf = x.float()
    pad = F.pad(xf, (0, -C % BLOCK, 0, -R % br))
    Rb, Cb = pad.shape[0] // br, pad.shape[1] // BLOCK
    amax = pad.view(Rb, br, Cb, BLOCK).abs().amax(dim=(1, 3))
    scale, inv = block_scales(amax)
    full = inv.repeat_interleave(br, 0)[:R].repeat_interleave(BLOCK, 1)[:, :C]
    codes = (xf * full).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return codes, scale


def block_scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block amax (fp32) -> (scale = amax / 448, its quantising factor 448 / amax), both 1
    for an all-zero block. Values are quantised as x * (448 / amax): the Triton kernel does the
    same fp32 operations, so the emulation matches it code for code."""
    nz = amax > 0
    one = torch.ones_like(amax)
    return (torch.where(nz, amax / FP8_MAX, one),
            torch.where(nz, FP8_MAX / torch.where(nz, amax, one), one))


def block_dequantize(codes: torch.Tensor, scale: torch.Tensor, rows_per_block: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of block_quantize: codes [R, C] * their block's scale, in `dtype`."""
    R, C = codes.shape
    full = scale.repeat_interleave(rows_per_block, 0)[:R].repeat_interleave(BLOCK, 1)[:, :C]
    return (codes.float() * full).to(dtype)


def fake_quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """x [n, K] quantised per 1 x 128 block and dequantised again, fp32: the activation as the
    FP8 GEMM sees it."""
    return block_dequantize(*block_quantize(x, 1), 1)


class FP8Weight(FormatBuffers):
    """A frozen e4m3 base weight [out, in] with 128 x 128 block scales (module docstring), as
    buffers `data` and `scale` (so `.to(device)` moves them; a dtype change reaches only the
    compute dtype, never the format). weight_dtype: the dtype it was quantised from (what export
    merges onto: the 16-bit source weights)."""

    def __init__(self, shape: tuple[int, int], weight_dtype: torch.dtype,
                 compute_dtype: torch.dtype | None = None, device=None):
        super().__init__(compute_dtype or weight_dtype, device)
        self.shape = tuple(int(s) for s in shape)
        self.weight_dtype = weight_dtype
        out_f, in_f = self.shape
        self.register_buffer("data", torch.empty(self.shape, dtype=FP8_DTYPE, device=device))
        self.register_buffer("scale", torch.empty(-(-out_f // BLOCK), -(-in_f // BLOCK),
                                                  dtype=torch.float32, device=device))

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def numel(self) -> int:
        """Weights held (what the parameter count counts)."""
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held: one a weight plus the fp32 block scales."""
        return self.data.numel() + self.scale.numel() * 4

    def extra_repr(self) -> str:
        return f"shape={self.shape}, weight_dtype={self.weight_dtype}, dtype={self.dtype}"

    @torch.no_grad()
    def quantize_(self, w: torch.Tensor) -> "FP8Weight":
        """Fill from a dense weight w [out, in] (any float dtype, any device), on this weight's
        device, 8192 rows at a time (the fp32 temporaries stay small)."""
        if tuple(w.shape) != self.shape:
            raise ValueError(f"quantize_: weight of shape {tuple(w.shape)}, expected {self.shape}")
        for r in range(0, self.shape[0], _QUANT_ROWS):
            codes, scale = block_quantize(w[r:r + _QUANT_ROWS].to(self.device), BLOCK)
            self.data[r:r + _QUANT_ROWS].copy_(codes)
            self.scale[r // BLOCK:r // BLOCK + scale.shape[0]].copy_(scale)
        return self

    def dequantize(self, out: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense weight [out, in] in `dtype` (default the compute dtype), into `out` when
        given (its dtype wins)."""
        w = block_dequantize(self.data, self.scale, BLOCK,
                             out.dtype if out is not None else (dtype or self.dtype))
        return w if out is None else out.copy_(w)


class FP8View:
    """The codes and block scales of several FP8 weights stacked by rows ([sum out, in]; each
    member's rows a multiple of 128), as one weight for one GEMM: views of one storage, which
    the members' own buffers also view (engine/weights.DenseWeights.fp8_packed)."""

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        self.data, self.scale, self.dtype = data, scale, dtype
        self.shape = tuple(data.shape)

    device = FP8Weight.device
    nbytes = FP8Weight.nbytes
    dequantize = FP8Weight.dequantize

    @classmethod
    def packed(cls, parts, shape, dtype) -> "FP8View":
        """New buffers holding `parts` ((codes, scales) per member) stacked."""
        return cls(torch.cat([d for d, _ in parts]), torch.cat([s for _, s in parts]), dtype)

    @classmethod
    def over(cls, parts, shape, dtype) -> "FP8View | None":
        """The view of `shape` over the storage `parts` already share, stacked in order, or
        None where they do not (moved, replaced)."""
        views = []
        for i in (0, 1):
            t0 = parts[0][i]
            storage, offset = t0.untyped_storage(), 0
            for p in parts:
                t = p[i]
                if (t.untyped_storage().data_ptr() != storage.data_ptr()
                        or t.storage_offset() != offset or not t.is_contiguous()):
                    return None
                offset += t.numel()
            rows = shape[0] if i == 0 else shape[0] // BLOCK
            views.append(torch.empty(0, dtype=t0.dtype, device=t0.device).set_(
                storage, 0, (rows, t0.shape[1]), (t0.shape[1], 1)))
        return cls(views[0], views[1], dtype)


# ------------------------------------------------------------------------------------------------
# the GEMMs: emulation (reference) and dispatch
# ------------------------------------------------------------------------------------------------
def fp8_mm_reference(x: torch.Tensor, w: FP8Weight, transpose: bool = False) -> torch.Tensor:
    """x [n, in] -> x W^T [n, out] (transpose=False), or dy [n, out] -> dy W [n, in]
    (transpose=True): the activation quantised per 1 x 128 block of the reduction dimension,
    the weight's codes and scales, multiplied in fp32 from the dequantised values; in x.dtype."""
    wf = w.dequantize(dtype=torch.float32)
    y = fake_quantize_rows(x) @ (wf if transpose else wf.t())
    return y.to(x.dtype)


def fp8_mm(x: torch.Tensor, w: FP8Weight, transpose: bool = False,
           out: torch.Tensor | None = None, resid: torch.Tensor | None = None,
           scratch: torch.Tensor | None = None) -> torch.Tensor:
    """resid + x W^T (transpose=False; x [n, in]) or resid + x W (transpose=True; x [n, out]),
    into `out` when given: the Triton kernel (kernels/fp8_gemm.py: activation quantised in the
    GEMM; `scratch`, an e4m3 [in, out] buffer for dX's transposed codes) where the kernels run,
    else the emulation. A forward of few rows (decoding) takes the weight-only GEMV instead
    (kernels/fp8_gemv.py: x unquantised; LEANTUNE_FP8_GEMV=0 switches it off). x may be a
    kernels/fp8_quant.QuantizedRows (x with its codes, made by the kernel that wrote x): the
    GEMMs that read codes take them; the others read its x."""
    from .dispatch import use_triton
    from .fp8_quant import plain

    xq, x = x, plain(x)
    if use_triton(x) and not emulating():
        from .fp8_gemv import fp8_gemv, gemv_applies

        if not transpose and gemv_applies(x):  # decoding: few rows, x not quantised
            return fp8_gemv(x, w, out=out, resid=resid)
        from .fp8_gemm import fp8_gemm

        return fp8_gemm(xq, w, transpose=transpose, out=out, resid=resid, scratch=scratch)
    y = fp8_mm_reference(x, w, transpose)
    if resid is not None:
        y = y + resid
    return y if out is None else out.copy_(y)


def takes_quantized(x: torch.Tensor, w, transpose: bool = False,
                    switch: bool | None = None) -> bool:
    """Whether fp8_mm(x, w, transpose) would quantise x by a pass of its own that the kernel
    producing x could do instead (it then passes a kernels/fp8_quant.QuantizedRows): the
    Triton kernels run, not emulated, not the GEMV, and the GEMM on the cuBLAS path with
    fused quantisation on (kernels/fp8_gemm.takes_quantized: `switch`, by default
    LEANTUNE_FP8_FUSED_QUANT's; the engine passes its own for input gradients, transpose)."""
    from .dispatch import use_triton

    if not use_triton(x) or emulating():
        return False
    from .fp8_gemm import takes_quantized as cublas_takes
    from .fp8_gemv import gemv_applies

    N, K = (w.shape[1], w.shape[0]) if transpose else (w.shape[0], w.shape[1])
    return (transpose or not gemv_applies(x)) and cublas_takes(x, N, K, switch)


__all__ = ["BLOCK", "FP8View", "FP8Weight", "FP8_DTYPE", "FP8_MAX", "block_dequantize", "block_quantize", "block_scales",
           "emulating", "fake_quantize_rows", "fp8_mm", "fp8_mm_reference", "fp8_unsupported",
           "takes_quantized"]
