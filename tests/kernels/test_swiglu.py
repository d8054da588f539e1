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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ACTS)
@pytest.mark.parametrize("rows,inter", [(5, 37), (1, 1), (3, 1030)])
def test_plain_functions_row_strided(dtype, name, rows, inter):
    """glu_fwd / glu_bwd_ as the fused layer calls them: gate and up are the two column halves
    of one [rows, 2 I] GEMM output, the forward writes into the left columns of a wider buffer,
    and the backward writes d gate / d up in place and act(gate) * up over dy (aliased)."""
    from leantune.kernels.swiglu import ACTS as CODES, glu_bwd_, glu_fwd

    act = CODES[name.replace("_none", "")]
    gu0 = (torch.randn(rows, 2 * inter) * 3).to(dtype)
    dy0 = torch.randn(rows, inter, dtype=dtype)
    g_ref = gu0[:, :inter].float().requires_grad_()
    u_ref = gu0[:, inter:].float().requires_grad_()
    with kernels.backend("reference"):
        h_ref = _op(name, g_ref, u_ref)
    dg_ref, du_ref = torch.autograd.grad(h_ref, (g_ref, u_ref), dy0.float())
    # fp32: 3000 values over a wide range meet the kernel's exp-built tanh in the last bits
    rtol, atol = TOL[dtype] if dtype != torch.float32 else (1e-5, 5e-5)
    for backend in ("triton", "reference"):
        with kernels.backend(backend):
            wide = torch.full((rows, inter + 3), 7.0, dtype=dtype)
            h = glu_fwd(gu0[:, :inter], gu0[:, inter:], act, out=wide[:, :inter])
            assert h.data_ptr() == wide.data_ptr()
            torch.testing.assert_close(h.float(), h_ref.detach(), rtol=rtol, atol=atol)
            assert (wide[:, inter:] == 7).all()  # columns beside the output untouched
            gu, dy = gu0.clone(), dy0.clone()
            glu_bwd_(dy, gu[:, :inter], gu[:, inter:], act, h_out=dy)
            torch.testing.assert_close(gu[:, :inter].float(), dg_ref, rtol=rtol, atol=atol)
            torch.testing.assert_close(gu[:, inter:].float(), du_ref, rtol=rtol, atol=atol)
            assert torch.equal(dy, h)  # the same rounding as glu_fwd


def test_plain_functions_reject_strided_columns():
    from leantune.kernels.swiglu import glu_fwd

    g = torch.randn(4, 6)
    with pytest.raises(ValueError, match="contiguous columns"):
        glu_fwd(g[:, ::2], g[:, 1::2], 0)
