"""Activation quantisation for the cuBLAS FP8 GEMM (kernels/fp8_gemm.py), and the e4m3 codes'
transpose for its input-gradient GEMM. Forward only: the frozen base's GEMMs have no backward
of their own (dX is another forward GEMM).

quantize_rows(x): x [M, K] (16/32-bit, any strides) -> (codes e4m3 [M, K] contiguous, scale_t
fp32 [ceil(K / 128), M] contiguous): per 1 x 128 block of a row, s = amax / 448 (1 for an
all-zero block) and q = round_e4m3(clamp(x * (448 * (1 / amax)), +-448)), the same fp32
operations as kernels/fp8.block_quantize (torch evaluates its 448 / amax as a reciprocal and a
product), so codes and scales agree with it bit for bit. The scales are stored transposed
(block-major, rows contiguous): scale_t.t() is the [M, K / 128] matrix with strides (1, M)
that cuBLAS's 1 x 128 block scaling reads ("outer-dim-major"; torch's scaled_mm checks these
strides). One pass over x: one program reads a BLOCK_M x 128 tile, takes the row amaxes in
registers and writes codes and scales.

transpose_codes_(src, dst): e4m3 [R, C] -> dst [C, R] through shared-memory tiles (a copy_ of a
transposed view reads one byte per 32-byte sector). dX = dY W reads W's codes K-major this way
(cuBLAS's Hopper FP8 GEMM takes row-major A and column-major B only).

QuantizedRows: a GEMM input x [M, K] together with its codes and scale_t, padded to
ROW_ALIGN rows as the cuBLAS GEMM reads them (kernels/fp8_gemm.py), so that a kernel that
produces x (RMSNorm, the GLU: kernels/rmsnorm.py, kernels/swiglu.py) writes them as it writes
x and the GEMM does not quantise x again. Those kernels quantise with `quantize_block`, the
block quantiser of quantize_rows' kernel, from the rounded 16-bit values they store: their
codes and scales equal quantize_rows(x) bit for bit.

Under TRITON_INTERPRET=1 (the tests) both run on the CPU; e4m3 goes through uint8 views.
"""

from __future__ import annotations

import torch

from .fp8 import BLOCK, FP8_DTYPE, block_quantize

try:
    import triton
    import triton.language as tl
except ImportError:  # the package works without Triton (the references only)
    triton = None


ROW_ALIGN = 16  # A's rows padded to a multiple (zero codes, scale 1): scale_a's strides are
                # (1, rows), and cuBLAS's scale tensors are read in aligned vectors


def quantize_rows_reference(x: torch.Tensor, codes: torch.Tensor | None = None,
                            scale_t: torch.Tensor | None = None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain-PyTorch quantize_rows: (codes [M, K] e4m3, scale_t [ceil(K / 128), M] fp32),
    copied into `codes` / `scale_t` when given (as quantize_rows)."""
    c, scale = block_quantize(x, 1)
    if codes is None and scale_t is None:
        return c, scale.t().contiguous()
    codes = c if codes is None else codes
    if codes is not c:
        codes.view(torch.uint8).copy_(c.view(torch.uint8))
    scale_t = scale.t().contiguous() if scale_t is None else scale_t.copy_(scale.t())
    return codes, scale_t


class QuantizedRows:
    """A GEMM input x [M, K] (16/32-bit) and its activation codes as the cuBLAS FP8 GEMM reads
    them: codes e4m3 [Mp, K] and scale_t fp32 [ceil(K / 128), Mp], both contiguous, Mp = M
    rounded up to ROW_ALIGN; the rows past M zero codes with scale 1 (in a row slice, `rows`,
    the next rows' codes: either way their products are dropped). Made by `empty` before the
    kernel that produces x, which writes `targets` (the first M rows) as it writes x;
    kernels/fp8_gemm.py's GEMMs then take it in place of x and quantise nothing."""

    def __init__(self, x: torch.Tensor, codes: torch.Tensor, scale_t: torch.Tensor):
        self.x, self.codes, self.scale_t = x, codes, scale_t

    @classmethod
    def empty(cls, x: torch.Tensor) -> "QuantizedRows":
        """Padded buffers for x [M, K] (the padding rows set, the first M to be written)."""
        M, K = x.shape
        mp = -(-M // ROW_ALIGN) * ROW_ALIGN
        codes = torch.empty(mp, K, dtype=FP8_DTYPE, device=x.device)
        scale_t = torch.empty(-(-K // BLOCK), mp, dtype=torch.float32, device=x.device)
        if mp > M:
            codes[M:].view(torch.uint8).zero_()
            scale_t[:, M:] = 1
        return cls(x, codes, scale_t)

    @property
    def targets(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [M, K], scale_t [K / 128, M] with row stride Mp): what the producer writes."""
        M = self.x.shape[0]
        return self.codes[:M], self.scale_t[:, :M]

    def rows(self, sl: slice) -> "QuantizedRows | None":
        """The rows `sl` (a step-1 slice) as a QuantizedRows (its scales copied contiguous
        unless it is every row: a row chunk of the MLP), or None where the slice's padded rows
        would leave the buffers (its GEMM then quantises x[sl] itself)."""
        M = self.x.shape[0]
        r0, r1, _ = sl.indices(M)
        if (r0, r1) == (0, M):
            return self
        end = r0 + -(-(r1 - r0) // ROW_ALIGN) * ROW_ALIGN
        if r0 % ROW_ALIGN or end > self.codes.shape[0]:
            return None
        return QuantizedRows(self.x[sl], self.codes[r0:end],
                             self.scale_t[:, r0:end].contiguous())


def check_targets(quant, rows: int, cols: int, who: str) -> None:
    """The one-line ValueError where `quant` (codes, scale_t) is not what a kernel writing the
    quantisation of a [rows, cols] output takes (QuantizedRows.targets' layout)."""
    codes, scale_t = quant
    kb = -(-cols // BLOCK)
    if (codes.dtype != FP8_DTYPE or tuple(codes.shape) != (rows, cols)
            or not codes.is_contiguous() or scale_t.dtype != torch.float32
            or tuple(scale_t.shape) != (kb, rows) or (rows > 1 and scale_t.stride(1) != 1)):
        raise ValueError(f"{who}: quant must be (codes e4m3 [{rows}, {cols}] contiguous, "
                         f"scale_t fp32 [{kb}, {rows}] with unit column stride), got "
                         f"{codes.dtype} {tuple(codes.shape)} and {scale_t.dtype} "
                         f"{tuple(scale_t.shape)} strides {scale_t.stride()}: pass "
                         "QuantizedRows.empty(out).targets")


def plain(x: "torch.Tensor | QuantizedRows") -> torch.Tensor:
    """The 16-bit tensor of a GEMM input (x itself, or a QuantizedRows' x)."""
    return x.x if isinstance(x, QuantizedRows) else x


def transpose_codes_reference(src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
    """src [R, C] e4m3 -> [C, R] contiguous (into dst when given), by torch's copy_."""
    dst = dst if dst is not None else torch.empty(src.shape[::-1], dtype=src.dtype,
                                                  device=src.device)
    dst.view(torch.uint8).copy_(src.view(torch.uint8).t())
    return dst


if triton is not None:

    @triton.jit
    def round_to_e4m3(v):
        """fp32 v (|v| <= 448) -> the nearest e4m3 value (ties to even), still fp32, so that the
        cast after it is exact: the Triton interpreter's fp32 -> e4m3 cast drops the carry of a
        rounding into the exponent (127.7 -> 64). Normal values keep 3 mantissa bits; below
        2^-6 (subnormal) values round to multiples of 2^-9 (an fp32 add at 1.5 * 2^14 rounds
        there)."""
        bits = v.to(tl.uint32, bitcast=True)
        normal = (((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) << 20).to(tl.float32,
                                                                          bitcast=True)
        sub = (tl.abs(v) + 24576.0) - 24576.0
        sub = tl.where((bits >> 31) != 0, -sub, sub)  # (the sign bit: -0 stays -0, as torch)
        return tl.where(tl.abs(v) < 0.015625, sub, normal)

    @triton.jit
    def quantize_block(x, AXIS: tl.constexpr, ROUND_FP32: tl.constexpr):
        """x fp32 holding 1 x 128 blocks along axis AXIS (the last) -> (codes: e4m3 bits as
        uint8, x's shape; scales fp32: x's shape without AXIS): s = amax / 448 (1 for an
        all-zero block), q = round_e4m3(clamp(x * (448 * (1 / amax)), +-448)), the fp32
        operations of fp8.block_quantize (torch evaluates its 448 / amax as a reciprocal, then
        a product), so the codes match it bit for bit. ROUND_FP32: round in fp32 before the
        cast (the interpreter: round_to_e4m3)."""
        amax = tl.max(tl.abs(x), axis=AXIS)
        s = tl.where(amax > 0, amax / 448.0, 1.0)
        inv = tl.where(amax > 0, (1.0 / tl.where(amax > 0, amax, 1.0)) * 448.0, 1.0)
        q = tl.clamp(x * tl.expand_dims(inv, AXIS), -448.0, 448.0)
        if ROUND_FP32:
            q = round_to_e4m3(q)
        return q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), s

    @triton.jit
    def _quantize_rows_kernel(X, Q, ST, M, K, stride_xm, stride_xk, stride_s,
                              ROUND_FP32: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_K: tl.constexpr):
        """Q[M, K] (uint8 view of e4m3, contiguous) and ST[K / 128, M] (row stride
        stride_s >= M) from X: program (pid_m, kb) does rows pid_m * BLOCK_M.. of column
        block kb."""
        pid_m = tl.program_id(0)
        kb = tl.program_id(1)
        rm = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_m = rm < M
        mask = mask_m[:, None] & (rk < K)[None, :]
        x = tl.load(X + rm[:, None] * stride_xm + rk[None, :] * stride_xk, mask=mask,
                    other=0.0).to(tl.float32)
        q, s = quantize_block(x, 1, ROUND_FP32)
        tl.store(Q + rm[:, None] * K + rk[None, :], q, mask=mask)
        tl.store(ST + kb * stride_s + rm, s, mask=mask_m)

    @triton.jit
    def _transpose_kernel(S, D, R, C, TILE: tl.constexpr):
        """D[C, R] = S[R, C]^T (uint8, contiguous), one TILE x TILE tile a program."""
        pid_r = tl.program_id(0)
        pid_c = tl.program_id(1)
        rr = (pid_r * TILE + tl.arange(0, TILE)).to(tl.int64)
        rc = (pid_c * TILE + tl.arange(0, TILE)).to(tl.int64)
        mask = (rr < R)[:, None] & (rc < C)[None, :]
        t = tl.load(S + rr[:, None] * C + rc[None, :], mask=mask, other=0)
        mask_t = (rc < C)[:, None] & (rr < R)[None, :]
        tl.store(D + rc[:, None] * R + rr[None, :], tl.trans(t), mask=mask_t)


def _tiles(device: torch.device) -> tuple[int, int]:
    """(rows a quantisation program, transpose tile edge): small in the interpreter (several
    programs even on tiny test shapes)."""
    return (64, 64) if device.type == "cuda" else (16, 32)


def quantize_rows(x: torch.Tensor, codes: torch.Tensor | None = None,
                  scale_t: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes e4m3 [M, K], scale_t fp32 [ceil(K / 128), M]) by the Triton kernel
    (module docstring), into `codes` (contiguous) / `scale_t` (unit column stride; a column
    view of a wider buffer, for padded rows) when given."""
    if x.dim() != 2:
        raise ValueError(f"quantize_rows: x must be 2-D [rows, K], got shape {tuple(x.shape)}")
    M, K = x.shape
    kb = -(-K // BLOCK)
    codes = codes if codes is not None else torch.empty(M, K, dtype=FP8_DTYPE, device=x.device)
    scale_t = scale_t if scale_t is not None else torch.empty(kb, M, dtype=torch.float32,
                                                              device=x.device)
    if M == 0 or K == 0:
        return codes, scale_t
    rows, _ = _tiles(x.device)
    _quantize_rows_kernel[(triton.cdiv(M, rows), kb)](
        x, codes.view(torch.uint8), scale_t, M, K, x.stride(0), x.stride(1), scale_t.stride(0),
        ROUND_FP32=not x.is_cuda, BLOCK_M=rows, BLOCK_K=BLOCK, num_warps=4)
    return codes, scale_t


def transpose_codes_(src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
    """src [R, C] e4m3 (contiguous) -> [C, R] contiguous, into dst when given: the Triton
    tiled transpose."""
    R, C = src.shape
    dst = dst if dst is not None else torch.empty(C, R, dtype=src.dtype, device=src.device)
    if tuple(dst.shape) != (C, R) or not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError(f"transpose_codes_: src {tuple(src.shape)} and dst {tuple(dst.shape)} "
                         "must be contiguous, dst the transposed shape")
    _, tile = _tiles(src.device)
    _transpose_kernel[(triton.cdiv(R, tile), triton.cdiv(C, tile))](
        src.view(torch.uint8), dst.view(torch.uint8), R, C, TILE=tile, num_warps=4)
    return dst


__all__ = ["QuantizedRows", "ROW_ALIGN", "check_targets", "plain", "quantize_rows", "quantize_rows_reference",
           "transpose_codes_", "transpose_codes_reference"]
