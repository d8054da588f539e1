"""The activation quantiser of the cuBLAS FP8 path (kernels/fp8_quant.py, Triton interpreter)
equals its plain-PyTorch reference code for code, with the scales in the transposed layout
cuBLAS reads; the tiled transpose of e4m3 codes equals torch's copy."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune.kernels.fp8 import FP8_DTYPE, block_quantize
from leantune.kernels.fp8_quant import (quantize_rows, quantize_rows_reference,
                                        transpose_codes_, transpose_codes_reference)


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[0, :3] = torch.tensor([200.0, -1e-4, 127.7])  # an outlier, a subnormal, a carry
    if shape[1] > 128:
        x[1, 128:256] = 0  # an all-zero block: scale 1, codes 0
    return x.to(dtype)


def _bytes(t):
    return t.view(torch.uint8)


@pytest.mark.parametrize("shape", [(5, 37), (19, 300), (9, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_equals_reference(shape, dtype):
    x = _x(shape, dtype)
    codes, scale_t = quantize_rows(x)
    ref_codes, ref_scale_t = quantize_rows_reference(x)
    assert codes.dtype == FP8_DTYPE and codes.shape == shape and codes.is_contiguous()
    assert scale_t.shape == (-(-shape[1] // 128), shape[0]) and scale_t.is_contiguous()
    assert torch.equal(_bytes(codes), _bytes(ref_codes))
    assert torch.equal(scale_t, ref_scale_t)
    # the layout cuBLAS reads: scale_t.t() is [M, K / 128] with strides (1, M), the values of
    # fp8.block_quantize's [M, K / 128] scales
    sa = scale_t.t()
    assert sa.stride() == (1, shape[0]) and torch.equal(sa, block_quantize(x, 1)[1])
    if shape[1] > 128:
        assert scale_t[1, 1] == 1 and torch.all(_bytes(codes)[1, 128:256] == 0)


def test_quantize_rows_reads_strided_input_into_given_buffers():
    X = _x((11, 400), torch.float32)
    x = X[:, 7:263]  # a column view of a wider buffer
    codes = torch.empty(11, 256, dtype=FP8_DTYPE)
    scale_t = torch.empty(2, 11)
    out = quantize_rows(x, codes, scale_t)
    assert out[0] is codes and out[1] is scale_t
    ref_codes, ref_scale_t = quantize_rows_reference(x.contiguous())
    assert torch.equal(_bytes(codes), _bytes(ref_codes)) and torch.equal(scale_t, ref_scale_t)


def test_quantize_rows_wants_a_matrix():
    with pytest.raises(ValueError, match="2-D"):
        quantize_rows(torch.randn(2, 3, 128))


@pytest.mark.parametrize("shape", [(7, 37), (130, 129), (16, 48)])
def test_tiled_transpose_equals_copy(shape):
    codes = block_quantize(torch.randn(shape), 128)[0]
    got = transpose_codes_(codes)
    assert got.shape == shape[::-1] and got.is_contiguous()
    assert torch.equal(_bytes(got), _bytes(transpose_codes_reference(codes)))
    dst = torch.empty(shape[::-1], dtype=FP8_DTYPE)
    assert transpose_codes_(codes, dst) is dst and torch.equal(_bytes(dst), _bytes(got))
    with pytest.raises(ValueError, match="transposed shape"):
        transpose_codes_(codes, torch.empty(shape, dtype=FP8_DTYPE) if shape[0] != shape[1]
                         else torch.empty(1, 1, dtype=FP8_DTYPE))


@pytest.mark.parametrize("layout", ["direct", "transpose"])
def test_triton_gemm_on_prequantised_codes_equals_emulation(layout, monkeypatch):
    """LEANTUNE_FP8_ACT_QUANT=pass: the Triton GEMM reads quantize_rows' codes and scales (the
    same codes as the emulation's, bit for bit) instead of quantising per tile; both ways agree
    with the emulation, with a residual and a strided output."""
    from leantune.kernels import fp8_gemm as gemm
    from leantune.kernels.fp8 import FP8Weight, fp8_mm_reference

    monkeypatch.setattr(gemm, "_dx_layout", layout)
    q = FP8Weight((130, 300), torch.float32).quantize_(_x((130, 300), torch.float32) * 0.02)
    x, dy = _x((21, 300), torch.float32, 1), _x((21, 130), torch.float32, 2)
    resid = torch.randn(21, 130)
    Y = torch.zeros(21, 140)
    got = {}
    for where in ("pass", "kernel"):
        monkeypatch.setattr(gemm, "_act_quant", where)
        assert gemm.prequantizes(21) == (where == "pass")
        got[where] = (gemm.fp8_gemm(x, q, out=Y[:, 5:135], resid=resid).clone(),
                      gemm.fp8_gemm(dy, q, transpose=True))
    y_ref, dx_ref = fp8_mm_reference(x, q) + resid, fp8_mm_reference(dy, q, transpose=True)
    for y, dx in got.values():
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    assert torch.all(Y[:, :5] == 0) and torch.all(Y[:, 135:] == 0)
    monkeypatch.setattr(gemm, "_act_quant", "auto")
    assert not gemm.prequantizes(8) and gemm.prequantizes(gemm.PREQUANT_MIN_ROWS)
    with pytest.raises(ValueError, match="LEANTUNE_FP8_ACT_QUANT"):
        gemm.set_act_quant("fused")
