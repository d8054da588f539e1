"""Triton SwiGLU / GeGLU (run by the Triton interpreter on CPU) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels

# (rtol, atol) per dtype. fp32: the activation's formula differs in the last bits (the kernel's
# tanh is built from exp). bf16: the reference rounds act(g) to bf16 before multiplying by u, the
# kernel rounds once, and the gradients are rounded to bf16: ~1-2 bf16 ulps.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}

ACTS = ["silu", "gelu_tanh", "gelu_none"]


def _op(name, g, u):
    if name == "silu":
        return kernels.swiglu(g, u)
    return kernels.geglu(g, u, name.split("_")[1])


def _run(name, g0, u0, dy, triton: bool):
    """As in the model: gate/up are fresh intermediates (g0 * 1), so backward works in place."""
    with kernels.backend("triton" if triton else "reference"):
        out = _op(name, g0 * 1, u0 * 1)
    return out, torch.autograd.grad(out, (g0, u0), dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("shape", [(2, 3, 100), (1, 1, 7)])
def test_matches_reference(dtype, name, shape):
    g0 = (torch.randn(shape) * 3).to(dtype).requires_grad_()  # wide range: both tails of act
    u0 = torch.randn(shape, dtype=dtype, requires_grad=True)
    dy = torch.randn(shape, dtype=dtype)
    out, g = _run(name, g0, u0, dy, True)
    out_ref, g_ref = _run(name, g0, u0, dy, False)
    rtol, atol = TOL[dtype]
    assert out.dtype == out_ref.dtype
    torch.testing.assert_close(out, out_ref, rtol=rtol, atol=atol)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", ACTS)
def test_leaves_and_views(name):
    """Leaves get fresh grads (never overwritten); non-contiguous views (chunks of a fused
    gate_up output) work; one of the two not requiring grad."""
    gu = torch.randn(3, 200, requires_grad=True)
    up_frozen = torch.randn(3, 100)
    dy = torch.randn(3, 100)
    with kernels.backend("triton"):
        g, u = gu.chunk(2, dim=-1)
        out = _op(name, g, u) + _op(name, gu[:, :100], up_frozen)
    before = gu.detach().clone()
    (grad,) = torch.autograd.grad(out, gu, dy)
    assert torch.equal(gu.detach(), before)
    g, u = gu.chunk(2, dim=-1)
    out_ref = _op(name, g, u) + _op(name, gu[:, :100], up_frozen)
    (grad_ref,) = torch.autograd.grad(out_ref, gu, dy)
    rtol, atol = TOL[torch.float32]
    torch.testing.assert_close(out, out_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(grad, grad_ref, rtol=rtol, atol=atol)


def test_backward_reuses_saved_buffers_and_guards_retain_graph():
    g0 = torch.randn(4, 100, requires_grad=True)
    u0 = torch.randn(4, 100, requires_grad=True)
    with kernels.backend("triton"):
        g, u = g0 * 1, u0 * 1
        out = kernels.swiglu(g, u)
    dg, du = torch.autograd.grad(out, (g, u), torch.ones_like(out), retain_graph=True)
    assert dg.data_ptr() == g.data_ptr() and du.data_ptr() == u.data_ptr()  # in place
    with pytest.raises(RuntimeError, match="inplace"):  # the saved buffers now hold grads
        torch.autograd.grad(out, (g, u), torch.ones_like(out))
