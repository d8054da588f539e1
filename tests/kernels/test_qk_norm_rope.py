"""q/k RMSNorm + RoPE (Qwen3): the Triton kernel (through the interpreter) and the PyTorch
fallback against autograd through the reference (RMSNorm then RoPE), forward and backward, on
small odd shapes, strided views into one q/k/v buffer, packed positions, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels.qk_norm_rope import (qk_norm_rope_bwd_, qk_norm_rope_fwd,
                                           qk_norm_rope_reference)
from leantune.model.rope import rope_cos_sin, rope_inv_freq

# fp32: the same math fused differently. bf16: the reference rounds each op (HF's order), the
# kernel rounds where transformers rounds the norm's output and once after the rotation.
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-2, 2e-2)}


def _inputs(B, T, Hq, Hk, D, dtype, seed=0):
    """q, k as strided views of one [B, T, (Hq + 2 Hk) D] projection output, as in the layer."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g) * 3).to(dtype)
    q = qkv[..., :Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
    wq = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    wk = (1 + 0.3 * torch.randn(D, generator=g)).to(dtype)
    pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(B, T)  # 2 docs
    inv, scale = rope_inv_freq(D, 10000.0, None)
    cos, sin = rope_cos_sin(pos, inv, scale, dtype)
    return q, k, wq, wk, cos, sin


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,offset", [((2, 5, 3, 1, 12), 0.0), ((1, 7, 4, 2, 16), 1.0),
                                          ((3, 3, 5, 5, 6), 0.0)])
def test_forward_and_backward_match_reference(backend, dtype, shape, offset):
    B, T, Hq, Hk, D = shape
    q, k, wq, wk, cos, sin = _inputs(B, T, Hq, Hk, D, dtype)
    eps = 1e-6
    with kernels.backend(backend):
        qo, ko = qk_norm_rope_fwd(q, k, wq, wk, eps, offset, cos, sin)
    q0, k0 = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    q_ref, k_ref = qk_norm_rope_reference(q0, k0, wq, wk, eps, offset, cos, sin)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(qo, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(ko, k_ref, rtol=rtol, atol=atol)
    assert torch.equal(q, q0) and torch.equal(k, k0)  # inputs untouched

    g = torch.Generator().manual_seed(1)
    dq_out = torch.randn(q.shape, generator=g).to(dtype)
    dk_out = torch.randn(k.shape, generator=g).to(dtype)
    gq_ref, gk_ref = torch.autograd.grad((q_ref, k_ref), (q0, k0), (dq_out, dk_out))
    # the gradients arrive as strided views too (the layer's d q | d k | d v buffer)
    dqkv = torch.zeros(B, T, (Hq + 2 * Hk) * D, dtype=dtype)
    dq = dqkv[..., :Hq * D].view(B, T, Hq, D)
    dk = dqkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
    dq.copy_(dq_out)
    dk.copy_(dk_out)
    with kernels.backend(backend):
        qk_norm_rope_bwd_(dq, dk, q, k, wq, wk, eps, offset, cos, sin)
    scale = 4 if dtype == torch.bfloat16 else 1  # gradients: a few more bf16 roundings
    torch.testing.assert_close(dq, gq_ref, rtol=scale * rtol, atol=scale * atol)
    torch.testing.assert_close(dk, gk_ref, rtol=scale * rtol, atol=scale * atol)
    assert not dqkv[..., (Hq + Hk) * D:].any()  # v's gradient columns untouched


def test_odd_head_dim_is_refused():
    q = torch.randn(1, 2, 2, 5)
    with pytest.raises(ValueError, match="even head_dim"):
        qk_norm_rope_fwd(q, q, torch.ones(5), torch.ones(5), 1e-6, 0.0, torch.ones(1, 2, 5),
                         torch.zeros(1, 2, 5))
