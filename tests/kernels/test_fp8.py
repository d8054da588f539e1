"""FP8 (e4m3, 128 x 128 block scales): the quantiser stays within e4m3's rounding bound, the
container keeps its format through `.to()`, and the Triton GEMM (interpreter; activation
quantised inside it) equals the PyTorch emulation, forward and input gradient, both dX layouts,
with a residual / accumulation, on odd shapes whose blocks end part-way."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.kernels import fp8_gemm as gemm
from leantune.kernels.fp8 import (BLOCK, FP8_DTYPE, FP8Weight, block_dequantize,
                                  block_quantize, fake_quantize_rows, fp8_mm, fp8_mm_reference)

SHAPES = [(7, 37), (130, 129), (64, 300)]  # [out, in]; blocks of 128 end part-way


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, 0] = 0.9  # an outlier in the first block
    if shape[0] > BLOCK:
        w[BLOCK:, :BLOCK] = 0  # an all-zero block (scale 1, codes 0)
    return w


def _rel_bound(x: torch.Tensor, scale_full: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: |error| <= 2^-4 |x|, or half the subnormal step
    (2^-10 times the block scale) near zero."""
    return torch.maximum(x.abs() * 2.0**-4, scale_full * 2.0**-10) * (1 + 1e-6)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_quantisation_within_e4m3_rounding(shape, dtype):
    w = _weight(shape).to(dtype)
    q = FP8Weight(shape, dtype).quantize_(w)
    assert q.data.dtype == FP8_DTYPE and q.scale.shape == (-(-shape[0] // 128),
                                                           -(-shape[1] // 128))
    assert q.nbytes == shape[0] * shape[1] + q.scale.numel() * 4
    back = q.dequantize(dtype=torch.float32)
    full = q.scale.repeat_interleave(128, 0)[:shape[0]].repeat_interleave(128, 1)[:, :shape[1]]
    err = (back - w.float()).abs()
    assert torch.all(err <= _rel_bound(w.float(), full)), err.max()
    assert err.max() > 0
    # each block's largest |w| maps to 448 (up to fp32 rounding), all-zero blocks stay zero
    assert (q.data.float().abs().amax() - 448).abs() < 1e-3
    if shape[0] > BLOCK:
        assert q.scale[1, 0] == 1 and torch.all(back[BLOCK:, :BLOCK] == 0)


def test_quantising_in_row_chunks_equals_one_pass(monkeypatch):
    import leantune.kernels.fp8 as fp8

    w = _weight((300, 129))
    whole = FP8Weight(w.shape, w.dtype).quantize_(w)
    monkeypatch.setattr(fp8, "_QUANT_ROWS", 128)
    chunked = FP8Weight(w.shape, w.dtype).quantize_(w)
    assert torch.equal(whole.data.view(torch.uint8), chunked.data.view(torch.uint8))
    assert torch.equal(whole.scale, chunked.scale)


def test_activation_blocks_are_one_row_by_128():
    x = torch.randn(5, 300)
    x[2, 130] = 50.0  # an outlier: only its own 1 x 128 block's scale grows
    codes, scale = block_quantize(x, 1)
    assert scale.shape == (5, 3)
    assert scale[2, 1] == 50.0 / 448 and scale[2, 0] < 1 and scale[3, 1] < 1
    torch.testing.assert_close(block_dequantize(codes, scale, 1), fake_quantize_rows(x))


def test_container_keeps_its_format_through_to():
    q = FP8Weight((7, 37), torch.float32).quantize_(_weight((7, 37)))
    codes = q.data.clone()
    q = q.to(torch.bfloat16)
    assert q.dtype == torch.bfloat16 and q.data.dtype == FP8_DTYPE
    assert q.scale.dtype == torch.float32 and torch.equal(q.data.view(torch.uint8),
                                                          codes.view(torch.uint8))
    assert q.dequantize().dtype == torch.bfloat16


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("layout", gemm.DX_LAYOUTS)
def test_triton_gemm_equals_emulation(shape, layout, monkeypatch):
    """The kernel quantises x per 1 x 128 block as the emulation does, code for code; only the
    order of fp32 sums differs. Both are close to the fp32 GEMM of the unquantised values."""
    monkeypatch.setattr(gemm, "_dx_layout", layout)
    w = _weight(shape)
    q = FP8Weight(shape, torch.float32).quantize_(w)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(19, shape[1], generator=g)
    dy = torch.randn(19, shape[0], generator=g)
    y, dx = gemm.fp8_gemm(x, q), gemm.fp8_gemm(dy, q, transpose=True)
    y_ref, dx_ref = fp8_mm_reference(x, q), fp8_mm_reference(dy, q, transpose=True)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, dx_ref, rtol=1e-5, atol=1e-5)
    # the quantisation error against fp32: a few % of the outputs' spread
    assert (y_ref - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()
    assert (dx_ref - dy @ w).abs().max() < 0.1 * (dy @ w).abs().max()


def test_strided_inputs_outputs_residual_and_accumulation():
    """The engine's GEMMs read column views and write into column views of wider buffers."""
    q = FP8Weight((40, 129), torch.float32).quantize_(_weight((40, 129)))
    X = torch.randn(9, 140)
    x = X[:, :129]
    resid = torch.randn(9, 40)
    Y = torch.zeros(9, 50)
    out = Y[:, 5:45]
    with kernels.backend("triton"):
        fp8_mm(x, q, out=out, resid=resid)
    torch.testing.assert_close(out, fp8_mm_reference(x.contiguous(), q) + resid,
                               rtol=1e-5, atol=1e-5)
    assert torch.all(Y[:, :5] == 0) and torch.all(Y[:, 45:] == 0)
    dy = torch.randn(9, 40)
    acc = torch.randn(9, 129)
    want = acc + fp8_mm_reference(dy, q, transpose=True)
    for backend in ("triton", "reference"):
        got = acc.clone()
        with kernels.backend(backend):
            fp8_mm(dy, q, transpose=True, out=got, resid=got)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bf16_activations():
    q = FP8Weight((64, 256), torch.bfloat16).quantize_(_weight((64, 256)).bfloat16())
    x = torch.randn(8, 256).bfloat16()
    y = gemm.fp8_gemm(x, q)
    assert y.dtype == torch.bfloat16
    # one bf16 rounding of the output apart (the interpreter truncates fp32 -> bf16 casts)
    ref = fp8_mm_reference(x, q).float()
    assert (y.float() - ref).abs().max() <= 2.0**-7 * ref.abs().max()


def test_wrong_input_width_is_one_line():
    q = FP8Weight((8, 16), torch.float32).quantize_(torch.randn(8, 16))
    with pytest.raises(ValueError, match="K = 8"):
        gemm.fp8_gemm(torch.randn(3, 16), q, transpose=True)


def test_gpu_autotuning_tries_tiles_that_fit_the_rows():
    """Decoding (a few rows) tries the small-M tiles only; a training GEMM the 64+ row ones."""
    def heights(m):
        pruned = gemm._prune(gemm._CUDA_CONFIGS, {"M_KEY": 1 << (m - 1).bit_length()})
        return {c.kwargs["BLOCK_M"] for c in pruned}

    assert heights(1) == heights(9) == {16}
    assert heights(30) == {16, 32}
    assert heights(100) == {64, 128} and heights(8192) == {64, 128, 256}
