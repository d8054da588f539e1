"""LoRA linear as one autograd Function in plain PyTorch (no Triton): the base matmul and the LoRA product.

    y = x @ W^T + b + s * (x @ A^T) @ B^T          x: [N, in], W: [out, in] (frozen),
                                                     A: [r, in], B: [out, r], s: scaling
Forward adds the LoRA product into the base output in place (addmm), so no [N, out] LoRA
temporary exists. Saved for backward: x, the small xa = x @ A^T [N, r], and references to W, A, B
(no copies). Backward computes no gradient for W (frozen base), and folds the LoRA input gradient
into the base one with addmm:

    gB = s * g^T @ xa        ga = s * g @ B        gA = ga^T @ x        gx = g @ W + ga @ A

The reference is the same math in plain autograd ops (`lora_linear_reference`). The fused version
is used when the layer has no dropout (dropout needs its mask in backward; then the reference
runs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.dispatch import get_backend


def lora_linear_reference(x, weight, bias, lora_a, lora_b, scaling: float):
    """x: [..., in] -> [..., out] with plain autograd."""
    y = F.linear(x, weight, bias)
    return y + F.linear(F.linear(x, lora_a), lora_b) * scaling


class _LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, lora_a, lora_b, scaling):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        a = lora_a.to(x.dtype)
        b = lora_b.to(x.dtype)
        xa = x2 @ a.t()  # [N, r]
        if bias is not None:
            y = torch.addmm(bias.to(x.dtype), x2, weight.t())
        else:
            y = x2 @ weight.t()
        y.addmm_(xa, b.t(), alpha=scaling)
        ctx.save_for_backward(x2, xa, weight, a, b)
        ctx.scaling = scaling
        ctx.shape = shape
        ctx.dtypes = (lora_a.dtype, lora_b.dtype)
        ctx.bias_grad = bias is not None and bias.requires_grad
        ctx.weight_grad = weight.requires_grad
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, gy):
        x2, xa, weight, a, b = ctx.saved_tensors
        s = ctx.scaling
        g = gy.reshape(-1, gy.shape[-1])
        ga = (g @ b) * s  # [N, r]
        grad_b = ((g.t() @ xa) * s).to(ctx.dtypes[1]) if ctx.needs_input_grad[4] else None
        grad_a = (ga.t() @ x2).to(ctx.dtypes[0]) if ctx.needs_input_grad[3] else None
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.addmm(ga @ a, g, weight).view(ctx.shape)
        grad_w = (g.t() @ x2) if ctx.weight_grad else None
        grad_bias = g.sum(0) if ctx.bias_grad else None
        return grad_x, grad_w, grad_bias, grad_a, grad_b, None


def lora_linear(x, weight, bias, lora_a, lora_b, scaling: float):
    """Fused LoRA linear unless the backend is forced to "reference"."""
    if get_backend() == "reference":
        return lora_linear_reference(x, weight, bias, lora_a.to(x.dtype), lora_b.to(x.dtype),
                                     scaling)
    return _LoRALinearFunction.apply(x, weight, bias, lora_a, lora_b, scaling)
