"""The cuBLAS FP8 path's glue (kernels/fp8_gemm.cublas_gemm: activation quantisation, scale
layouts, dX's transposed codes and scales, out / resid) on the CPU: the scaled-mm call is
replaced by emulate_scaled_mm, which takes exactly the tensors cuBLAS would get and checks their
layouts as torch does, so a layout mistake fails here. Where this torch has its meta shape
checks for F.scaled_mm, they accept the same tensors."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.kernels import fp8_gemm as gemm
from leantune.kernels.fp8 import FP8_DTYPE, FP8Weight, fp8_mm_reference
from leantune.kernels.fp8_quant import quantize_rows, quantize_rows_reference

# [out, in]: K / 128 = 3 pads the 128 x 128 scales to 4 blocks (both ways round); 4 does not
SHAPES = [(256, 384), (384, 128), (128, 512)]


def _weight(shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, 0] = 0.9  # one block's scale much larger than its neighbours'
    w[128:, :128] *= 1e-3  # and one much smaller: a scale read from the wrong block shows
    return FP8Weight(shape, torch.float32).quantize_(w)


def _emulated(*args, **kw):
    return gemm.cublas_gemm(*args, scaled_mm=gemm.emulate_scaled_mm, **kw)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("rows", [19, 32])
def test_cublas_glue_equals_emulation_forward_and_dx(shape, backend, rows):
    """Triton backend: the interpreter's quantiser and transpose; reference: their PyTorch
    forms. Both give fp8_mm_reference's result (same codes and scales; fp32 sums). 19 rows
    are padded to 32 for cuBLAS (zero codes, scale 1)."""
    q = _weight(shape)
    g = torch.Generator().manual_seed(1)
    x, dy = torch.randn(rows, shape[1], generator=g), torch.randn(rows, shape[0], generator=g)
    with kernels.backend(backend):
        y, dx = _emulated(x, q), _emulated(dy, q, transpose=True)
    torch.testing.assert_close(y, fp8_mm_reference(x, q), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx, fp8_mm_reference(dy, q, transpose=True), rtol=1e-5, atol=1e-5)


def test_out_resid_scratch_and_accumulation():
    q = _weight((256, 384))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 400, generator=g)[:, 3:387]  # a strided column view
    resid = torch.randn(9, 256, generator=g)
    want = fp8_mm_reference(x.contiguous(), q) + resid
    Y = torch.zeros(9, 300)
    with kernels.backend("triton"):
        _emulated(x, q, out=Y[:, 10:266], resid=resid)  # strided out
        torch.testing.assert_close(Y[:, 10:266], want, rtol=1e-5, atol=1e-5)
        assert torch.all(Y[:, :10] == 0) and torch.all(Y[:, 266:] == 0)
        direct = torch.empty(9, 256)  # contiguous out, no resid (9 rows: through a padded temp)
        assert _emulated(x, q, out=direct) is direct
        torch.testing.assert_close(direct, want - resid, rtol=1e-5, atol=1e-5)
        x16 = torch.randn(16, 384, generator=g)  # aligned rows: written by the call itself
        direct = torch.empty(16, 256)
        seen = []

        def spy(*args, out=None):
            seen.append(out)
            return gemm.emulate_scaled_mm(*args, out=out)

        assert gemm.cublas_gemm(x16, q, out=direct, scaled_mm=spy) is direct and seen == [direct]
        torch.testing.assert_close(direct, fp8_mm_reference(x16, q), rtol=1e-5, atol=1e-5)
        r16 = torch.randn(16, 256, generator=g)  # a residual in another tensor: still direct
        assert gemm.cublas_gemm(x16, q, out=direct, resid=r16, scaled_mm=spy) is direct
        assert seen[-1] is direct
        torch.testing.assert_close(direct, fp8_mm_reference(x16, q) + r16, rtol=1e-5, atol=1e-5)
        acc = r16.clone()  # the residual is the output: through a temporary
        gemm.cublas_gemm(x16, q, out=acc, resid=acc, scaled_mm=spy)
        assert seen[-1] is None
        torch.testing.assert_close(acc, fp8_mm_reference(x16, q) + r16, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(_emulated(x, q, resid=resid), want, rtol=1e-5, atol=1e-5)
        dy = torch.randn(9, 256, generator=g)
        acc = torch.randn(9, 384, generator=g)
        want_dx = acc + fp8_mm_reference(dy, q, transpose=True)
        scratch = torch.empty(384, 256, dtype=FP8_DTYPE)
        _emulated(dy, q, transpose=True, out=acc, resid=acc, scratch=scratch)
        torch.testing.assert_close(acc, want_dx, rtol=1e-5, atol=1e-5)
        assert torch.equal(scratch.view(torch.uint8), q.data.view(torch.uint8).t())


def _operands(M=8, N=256, K=384):
    q = _weight((N, K))
    codes, scale_t = quantize_rows(torch.randn(M, K))
    return codes, q.data.t(), scale_t.t(), gemm.weight_scales_for_cublas(q.scale)


def test_padded_rows_are_zero_codes_with_unit_scales():
    x = torch.randn(5, 256)
    for triton_kernel in (True, False):
        codes, scale_t = gemm.quantize_padded(x, triton_kernel)
        assert codes.shape == (16, 256) and scale_t.shape == (2, 16)
        assert torch.all(codes[5:].view(torch.uint8) == 0) and torch.all(scale_t[:, 5:] == 1)
        ref_codes, ref_scale_t = quantize_rows_reference(x)
        assert torch.equal(codes[:5].view(torch.uint8), ref_codes.view(torch.uint8))
        assert torch.equal(scale_t[:, :5], ref_scale_t)


def test_operands_have_the_layouts_torch_checks():
    a, b, sa, sb = _operands()
    assert sa.shape == (8, 3) and sa.stride() == (1, 8)
    assert sb.shape == (4, 2) and sb.stride() == (1, 4) and torch.all(sb[3] == 0)
    gemm.check_blockwise_operands(a, b, sa, sb)
    meta = pytest.importorskip("torch._meta_registrations")
    check = getattr(meta, "_check_scaled_mm_sizes_v2", None)
    F = torch.nn.functional
    if check is None or not hasattr(F, "ScalingType"):
        pytest.skip("this torch has no F.scaled_mm meta checks")
    # torch's own shape / stride checks of the (BlockWise1x128, BlockWise128x128) recipe
    recipe_a = [F.ScalingType.BlockWise1x128.value]
    recipe_b = [F.ScalingType.BlockWise128x128.value]
    check(a, b, [sa], recipe_a, [sb], recipe_b, out_dtype=torch.float32)
    with pytest.raises(RuntimeError):
        check(a, b, [sa.contiguous()], recipe_a, [sb], recipe_b, out_dtype=torch.float32)


@pytest.mark.parametrize("mistake", ["scale_a row-major", "scale_b unpadded",
                                     "scale_b untransposed", "B row-major"])
def test_layout_mistakes_fail_on_the_cpu(mistake):
    a, b, sa, sb = _operands()
    if mistake == "scale_a row-major":
        sa = sa.contiguous()
    elif mistake == "scale_b unpadded":
        sb = sb[:3]
    elif mistake == "scale_b untransposed":
        sb = sb.t().contiguous()
    else:
        b = b.contiguous()
    with pytest.raises(ValueError, match="blockwise scaled mm"):
        gemm.emulate_scaled_mm(a, b, sa, sb, torch.float32)


def test_emulation_applies_each_block_its_own_scale():
    """The emulation against a dense fp32 product of the dequantised operands."""
    a, b, sa, sb = _operands(M=5, N=256, K=384)
    da = a.float() * sa.repeat_interleave(128, 1)
    wb = sb[:3].t()  # [N/128, K/128]
    db = b.t().float() * wb.repeat_interleave(128, 0).repeat_interleave(128, 1)
    torch.testing.assert_close(gemm.emulate_scaled_mm(a, b, sa, sb, torch.float32), da @ db.t(),
                               rtol=1e-6, atol=1e-6)


def test_path_switch_and_cpu_dispatch(monkeypatch):
    with pytest.raises(ValueError, match="LEANTUNE_FP8_GEMM"):
        gemm.set_gemm_path("fast")
    assert gemm.gemm_path() in gemm.GEMM_PATHS
    assert all(v and "cpu" in v for v in gemm.probe_cublas(torch.device("cpu")).values())
    monkeypatch.setattr(gemm, "_gemm_path", "triton")
    assert gemm.cublas_reason(torch.device("cpu")) == "LEANTUNE_FP8_GEMM=triton"
    x = torch.randn(4, 128)
    assert not gemm.uses_cublas(x, 4, 128, 128)
    monkeypatch.setattr(gemm, "_gemm_path", "cuBLAS")  # (a bad LEANTUNE_FP8_GEMM: one line)
    with pytest.raises(ValueError, match="LEANTUNE_FP8_GEMM='cuBLAS': use one of auto"):
        gemm.uses_cublas(x, 4, 128, 128)



def test_auto_falls_back_to_triton_where_cublas_refuses(monkeypatch):
    """A shape cuBLASLt refuses at run time (one the probe did not try) goes to the Triton
    kernel, and later GEMMs of that shape go there directly; forced "cublas" raises."""
    q = _weight((128, 256))
    x = torch.randn(64, 256)
    calls = []

    def refuse(*args, **kw):
        calls.append(1)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(gemm, "_refused", {})
    monkeypatch.setattr(gemm, "cublas_reason", lambda device: None)
    monkeypatch.setattr(gemm, "_scaled_mm_for", lambda device, kb: refuse)
    monkeypatch.setattr(gemm, "cublas_gemm", refuse)
    assert gemm.try_cublas(x, q, False, None, None, None) is None  # refused: Triton's turn
    assert list(gemm._refused) == [(128, 256, torch.float32)] and len(calls) == 1
    assert not gemm.uses_cublas(x, 64, 128, 256)
    assert gemm.try_cublas(x, q, False, None, None, None) is None and len(calls) == 1
    monkeypatch.setattr(gemm, "_refused", {})
    with gemm.using_gemm_path("cublas"), pytest.raises(RuntimeError, match="NOT_SUPPORTED"):
        gemm.try_cublas(x, q, False, None, None, None)
    with gemm.using_gemm_path("auto"):
        assert not gemm.uses_cublas(x[:8], 8, 128, 256)  # few rows: the Triton kernel


def test_probe_passes_an_agreeing_entry_point_and_names_a_failing_one():
    """The probe's check, on the CPU: the emulation itself passes; an entry point that reads
    the weight scales from the wrong blocks disagrees; one that raises is named."""
    shapes = ((16, 256, 384),)
    cpu = torch.device("cpu")
    assert gemm.probe_entry(gemm.emulate_scaled_mm, cpu, shapes) is None

    def wrong_blocks(a, b, sa, sb, dtype, out=None):  # (flip keeps the strides)
        return gemm.emulate_scaled_mm(a, b, sa, sb.flip(1), dtype, out=out)

    def missing(*args, **kw):
        raise RuntimeError("no blockwise recipe\nsecond line")

    assert "disagrees" in gemm.probe_entry(wrong_blocks, cpu, shapes)
    assert gemm.probe_entry(missing, cpu, shapes) == "K=384: RuntimeError: no blockwise recipe"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the cuBLAS path runs on CUDA")
def test_on_the_gpu_cublas_equals_the_emulation():
    """(GPU only) Where the probe passes, the real scaled mm gives the emulation's result to
    bf16 rounding, forward and dX, at a padded-scale shape and at one that needs none."""
    dev = torch.device("cuda")
    if gemm.cublas_reason(dev) is not None:
        pytest.skip(f"no cuBLAS FP8 here: {gemm.cublas_reason(dev)}")
    for N, K in ((384, 256), (512, 1024)):
        q = FP8Weight((N, K), torch.bfloat16, device=dev).quantize_(
            torch.randn(N, K, device=dev) * 0.02)
        x = torch.randn(200, K, device=dev).bfloat16()
        dy = torch.randn(200, N, device=dev).bfloat16()
        for args, kw in (((x, q), {}), ((dy, q), dict(transpose=True))):
            y = gemm.cublas_gemm(*args, **kw).float()
            ref = _emulated(*args, **kw).float()
            assert ((y - ref).norm() / ref.norm()).item() < 1e-2
