"""Triton RoPE (run by the Triton interpreter on CPU) against the PyTorch reference."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels import apply_rope, apply_rope_reference
from leantune.model.rope import rope_cos_sin, rope_inv_freq

# (rtol, atol) per dtype. fp32: the same products and sums, only fused differently. bf16: the
# reference rounds each product to bf16 before adding, the kernel rounds once: ~1 bf16 ulp.
TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (1e-2, 1e-2)}


def _cos_sin(B, T, D, dtype, packed=True):
    if packed:  # two packed documents per row: positions restart at the boundary
        pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(B, T)
    else:
        pos = torch.arange(T).expand(B, T)
    inv, scale = rope_inv_freq(D, 10000.0, None)
    return rope_cos_sin(pos, inv, scale, dtype)


def _compare(q0, k0, cos, sin, dq, dk):
    """Rotate fresh copies (non-leaf, as in the model) on both paths; compare values and grads."""
    with kernels.backend("triton"):
        q, k = apply_rope(q0 * 1, k0 * 1, cos, sin)
    # Backward rotates the incoming gradients in place: hand it copies.
    g = torch.autograd.grad((q, k), (q0, k0), (dq.clone(), dk.clone()))
    q_ref, k_ref = apply_rope_reference(q0, k0, cos, sin)
    g_ref = torch.autograd.grad((q_ref, k_ref), (q0, k0), (dq, dk))
    rtol, atol = TOL[q0.dtype]
    torch.testing.assert_close(q, q_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(k, k_ref, rtol=rtol, atol=atol)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,Hq,Hk,D", [
    (2, 5, 4, 2, 24),   # GQA, head_dim/2 = 12: not a power of two (masked)
    (1, 1, 1, 1, 8),    # a single token
    (1, 3, 3, 3, 128),  # heads not a power of two
])
def test_matches_reference(dtype, B, T, Hq, Hk, D):
    cos, sin = _cos_sin(B, T, D, dtype)
    q0 = torch.randn(B, T, Hq, D, dtype=dtype, requires_grad=True)
    k0 = torch.randn(B, T, Hk, D, dtype=dtype, requires_grad=True)
    _compare(q0, k0, cos, sin, torch.randn_like(q0), torch.randn_like(k0))


def test_forward_is_in_place_on_intermediates():
    cos, sin = _cos_sin(1, 4, 16, torch.float32)
    q0 = torch.randn(1, 4, 2, 16, requires_grad=True)
    k0 = torch.randn(1, 4, 1, 16, requires_grad=True)
    q_in, k_in = q0 * 1, k0 * 1
    with kernels.backend("triton"):
        q, k = apply_rope(q_in, k_in, cos, sin)
    assert q.data_ptr() == q_in.data_ptr() and k.data_ptr() == k_in.data_ptr()


def test_leaves_are_not_overwritten():
    cos, sin = _cos_sin(1, 4, 16, torch.float32)
    q0 = torch.randn(1, 4, 2, 16, requires_grad=True)
    k0 = torch.randn(1, 4, 1, 16)  # a plain tensor: rotated in place (documented)
    q_before = q0.detach().clone()
    with kernels.backend("triton"):
        q, _ = apply_rope(q0, k0.clone(), cos, sin)
    assert torch.equal(q0.detach(), q_before)
    torch.testing.assert_close(q, apply_rope_reference(q0, k0, cos, sin)[0])


def test_non_contiguous_inputs_and_grads():
    """q/k as transposed views of [B, H, T, D] buffers, cos/sin broadcast over the batch,
    and stride-0 / shared gradients (from .sum() and from one add's backward)."""
    B, T, H, D = 2, 3, 2, 16
    cos, sin = _cos_sin(1, T, D, torch.float32, packed=False)
    cos, sin = cos.expand(B, T, D), sin.expand(B, T, D)
    qb = torch.randn(B, H, T, D, requires_grad=True)
    kb = torch.randn(B, H, T, D, requires_grad=True)
    with kernels.backend("triton"):
        q, k = apply_rope(qb.transpose(1, 2) * 1, kb.transpose(1, 2) * 1, cos, sin)
        loss = (q + k).pow(2).sum() + q.sum()
    g = torch.autograd.grad(loss, (qb, kb))
    q_ref, k_ref = apply_rope_reference(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
    torch.testing.assert_close(q, q_ref)
    loss_ref = (q_ref + k_ref).pow(2).sum() + q_ref.sum()
    g_ref = torch.autograd.grad(loss_ref, (qb, kb))
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_projection_view_is_rotated_in_place_and_grads_flow():
    """The model's q = q_proj(x).view(B, T, H, D) (a view of a whole base) is rotated in place
    through its base; with q/k norm (Triton RMSNorm outputs) the grads reach the norm weights."""
    B, T, Hq, Hk, D = 1, 4, 2, 1, 16
    cos, sin = _cos_sin(B, T, D, torch.float32)
    x = torch.randn(B, T, 8)
    wq = torch.randn(Hq * D, 8, requires_grad=True)
    wk = torch.randn(Hk * D, 8, requires_grad=True)
    norm_w = torch.randn(D, requires_grad=True)
    outs = {}
    for backend in ("triton", "reference"):
        with kernels.backend(backend):
            q_flat = x @ wq.t()
            q = q_flat.view(B, T, Hq, D)
            k = kernels.rms_norm((x @ wk.t()).view(B, T, Hk, D), norm_w, 1e-6)
            q_out, k_out = apply_rope(q, k, cos, sin)
            if backend == "triton":
                assert q_out.data_ptr() == q_flat.data_ptr()  # in place
            loss = (q_out * torch.arange(D)).sum() + (k_out.pow(2)).sum()
        outs[backend] = (q_out, k_out, torch.autograd.grad(loss, (wq, wk, norm_w)))
    for a, b in zip(outs["triton"][:2], outs["reference"][:2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(outs["triton"][2], outs["reference"][2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-4)
