"""Triton RMSNorm (run by the Triton interpreter on CPU) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels import rms_norm, rms_norm_reference

# (rtol, atol) per dtype. fp32: only summation order and rsqrt differ. bf16: the output and
# the gradients are rounded to bf16 (8 bits), and a last-bit difference in rstd can flip the
# rounding of x*rstd before the weight multiply: allow ~2 bf16 ulps.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
EPS = 1e-6


def _run(x, w, offset, triton: bool, dy):
    inputs = [t for t in (x, w) if t.requires_grad]
    with kernels.backend("triton" if triton else "reference"):
        y = rms_norm(x, w, EPS, offset)
    return y, torch.autograd.grad(y, inputs, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", [(2, 3, 72), (5, 100), (1, 1, 24)])
def test_matches_reference(dtype, offset, shape):
    H = shape[-1]
    x = torch.randn(shape, dtype=dtype, requires_grad=True)
    w = (torch.randn(H) * 0.2 + (0.0 if offset else 1.0)).to(dtype).requires_grad_()
    dy = torch.randn(shape, dtype=dtype)
    y, (dx, dw) = _run(x, w, offset, True, dy)
    y_ref, (dx_ref, dw_ref) = _run(x, w, offset, False, dy)
    rtol, atol = TOL[dtype]
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(dx, dx_ref, rtol=rtol, atol=atol)
    # dW sums over rows: scale the tolerance by the row count's square root.
    rows = x.numel() // H
    torch.testing.assert_close(dw, dw_ref, rtol=rtol, atol=atol * rows ** 0.5)


def test_fp32_weight_bf16_input_promotes_like_reference():
    x = torch.randn(4, 72, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(72, requires_grad=True)
    dy = torch.randn(4, 72)
    y, g = _run(x, w, 0.0, True, dy)
    y_ref, g_ref = _run(x, w, 0.0, False, dy)
    assert y.dtype == y_ref.dtype == torch.float32
    rtol, atol = TOL[torch.bfloat16]
    torch.testing.assert_close(y, y_ref, rtol=rtol, atol=atol)
    for a, b in zip(g, g_ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol * 2)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_frozen_weight_gets_no_grad(offset):
    x = torch.randn(3, 5, 72, requires_grad=True)
    w = torch.randn(72)  # frozen (LoRA): requires_grad False
    dy = torch.randn(3, 5, 72)
    with kernels.backend("triton"):
        y = rms_norm(x, w, EPS, offset)
    y.backward(dy)
    assert w.grad is None
    x_ref = x.detach().clone().requires_grad_()
    rms_norm_reference(x_ref, w, EPS, offset).backward(dy)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=rtol, atol=atol)


def test_weight_grad_only():
    x = torch.randn(6, 100)  # input does not require grad: only dW
    w = torch.randn(100, requires_grad=True)
    dy = torch.randn(6, 100)
    _, (dw,) = _run(x, w, 0.0, True, dy)
    _, (dw_ref,) = _run(x, w, 0.0, False, dy)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-5, atol=1e-5)


def test_non_contiguous_input():
    base = torch.randn(4, 3, 72)
    x = base.transpose(0, 1).requires_grad_()  # [3, 4, 72], rows not in memory order
    w = torch.randn(72, requires_grad=True)
    dy = torch.randn(3, 4, 72)
    y, g = _run(x, w, 0.0, True, dy)
    y_ref, g_ref = _run(x, w, 0.0, False, dy)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_plain_forward_into_wider_buffer(backend):
    """rms_norm_fwd(out=) writes the left columns of a wider buffer (the fused layer's packed
    input) and leaves the rest alone."""
    from leantune.kernels.rmsnorm import rms_norm_fwd

    x = torch.randn(7, 72)
    w = torch.randn(72)
    buf = torch.full((7, 80), 5.0)
    with kernels.backend(backend):
        y, rstd = rms_norm_fwd(x, w, EPS, 0.0, out=buf[:, :72])
    assert y.data_ptr() == buf.data_ptr()
    torch.testing.assert_close(buf[:, :72], rms_norm_reference(x, w, EPS), rtol=1e-5, atol=1e-5)
    assert (buf[:, 72:] == 5).all()
    torch.testing.assert_close(rstd, torch.rsqrt(x.pow(2).mean(-1) + EPS))


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_backward_adds_the_residual_gradient(backend, dtype):
    """rms_norm_bwd(residual=r) = rms_norm_bwd() + r, rounded once."""
    from leantune.kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd

    x, dy, r = (torch.randn(9, 100).to(dtype) for _ in range(3))
    w = torch.randn(100).to(dtype)
    with kernels.backend(backend):
        _, rstd = rms_norm_fwd(x, w, EPS)
        plain = rms_norm_bwd(dy, x, w, rstd)
        with_res = rms_norm_bwd(dy, x, w, rstd, residual=r)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(with_res, (plain.float() + r.float()).to(dtype), rtol=rtol,
                               atol=atol)
