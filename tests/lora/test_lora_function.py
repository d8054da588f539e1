"""LoRA autograd Function vs plain autograd: forward and all gradients."""

import pytest
import torch

from leantune.lora.function import _LoRALinearFunction, lora_linear_reference

# fp32: the same matmuls in another order -> rounding only. bf16: addmm fuses the add in the
# GEMM epilogue (one rounding instead of two), so allow bf16 resolution.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 1, 36), (2, 7, 36), (5, 36)])
def test_lora_linear_matches_reference(dtype, bias, shape):
    out_f, r, s = 20, 4, 1.7
    x = torch.randn(*shape, dtype=dtype, requires_grad=True)
    w = torch.randn(out_f, shape[-1], dtype=dtype) * 0.1  # frozen base
    b = torch.randn(out_f, dtype=dtype, requires_grad=True) if bias else None
    a = torch.randn(r, shape[-1], dtype=torch.float32, requires_grad=True)  # fp32 masters
    bb = torch.randn(out_f, r, dtype=torch.float32, requires_grad=True)
    g = torch.randn(*shape[:-1], out_f, dtype=dtype)
    inputs = [x, a, bb] + ([b] if bias else [])

    y1 = _LoRALinearFunction.apply(x, w, b, a, bb, s)
    g1 = torch.autograd.grad(y1, inputs, g)
    y2 = lora_linear_reference(x, w, b, a.to(dtype), bb.to(dtype), s)
    g2 = torch.autograd.grad(y2, inputs, g)
    tol = TOL[dtype]

    def rel(p, q):
        return ((p.float() - q.float()).norm() / q.float().norm().clamp_min(1e-12)).item()

    assert y1.dtype == dtype and y1.shape == y2.shape
    assert rel(y1, y2) < tol
    for p, q in zip(g1, g2):
        assert p.dtype == q.dtype
        assert rel(p, q) < tol


def test_base_weight_gets_no_gradient():
    x = torch.randn(3, 8, requires_grad=True)
    w = torch.randn(6, 8)
    a = torch.randn(2, 8, requires_grad=True)
    b = torch.randn(6, 2, requires_grad=True)
    _LoRALinearFunction.apply(x, w, None, a, b, 1.0).sum().backward()
    assert w.grad is None and a.grad is not None and b.grad is not None
