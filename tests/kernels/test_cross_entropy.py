"""Triton fused linear cross-entropy (run by the Triton interpreter on CPU) against the
reference (full logits + F.cross_entropy, summed)."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels import cross_entropy as ce

IGNORE = -100
# Loss (rtol, atol) per dtype: the logits are the same product on both paths and the loss is
# computed in fp32 either way; only the order of the sums differs.
LOSS_TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-4, 1e-3)}
# Gradient (rtol, atol) per dtype. bf16: the kernel rounds dlogits to bf16 before the matrix
# products and rounds the grads again after scaling by grad_output (the reference scales first):
# a few bf16 ulps.
GRAD_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 1e-2)}


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Vocab steps of 128, so V = 333 takes several steps and a masked last one."""
    monkeypatch.setattr(ce, "MAX_BLOCK_V", 128)


def _data(N, H, V, dtype, ignore_every=3):
    hidden = torch.randn(N, H, dtype=dtype, requires_grad=True)
    weight = (torch.randn(V, H) * 0.3).to(dtype).requires_grad_()
    labels = torch.randint(0, V, (N,))
    if ignore_every and N > 1:
        labels[::ignore_every] = IGNORE
    return hidden, weight, labels


def _check(hidden, weight, labels, softcap=None, grad_scale=0.37):
    """Loss and grads (of grad_scale * loss, to check the grad_output scaling) vs reference."""
    inputs = [t for t in (hidden, weight) if t.requires_grad]
    with kernels.backend("triton"):
        loss = kernels.fused_linear_cross_entropy(hidden, weight, labels, softcap, IGNORE)
    grads = torch.autograd.grad(loss * grad_scale, inputs)
    loss_ref = kernels.linear_cross_entropy_reference(hidden, weight, labels, softcap, IGNORE)
    grads_ref = torch.autograd.grad(loss_ref * grad_scale, inputs)
    assert loss.dtype == torch.float32 and loss.dim() == 0
    torch.testing.assert_close(loss, loss_ref, rtol=LOSS_TOL[hidden.dtype][0],
                               atol=LOSS_TOL[hidden.dtype][1])
    rtol, atol = GRAD_TOL[hidden.dtype]
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,V,softcap", [
    (9, 72, 333, None),   # V not a multiple of the vocab step; ignored rows
    (9, 72, 333, 5.0),    # soft-capped logits (cap small enough to bite)
    (1, 16, 333, 30.0),   # a single token
])
def test_matches_reference(dtype, N, H, V, softcap):
    _check(*_data(N, H, V, dtype), softcap=softcap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_chunks(dtype, monkeypatch):
    """A chunk budget of 4 rows: several chunks, a short last one, and (bf16) the fp32
    accumulation of W's gradient across chunks."""
    V = 100
    row_bytes = V * torch.empty((), dtype=dtype).element_size()
    monkeypatch.setitem(ce.CHUNK_BYTES, "default", 4 * row_bytes)
    _check(*_data(10, 40, V, dtype))


def test_frozen_weight():
    hidden, weight, labels = _data(7, 72, 333, torch.float32)
    weight.requires_grad_(False)
    _check(hidden, weight, labels)
    with kernels.backend("triton"):
        kernels.fused_linear_cross_entropy(hidden, weight, labels).backward()
    assert weight.grad is None and hidden.grad is not None


def test_weight_grad_only():
    hidden, weight, labels = _data(7, 72, 333, torch.float32)
    hidden.requires_grad_(False)
    _check(hidden, weight, labels)


def test_all_ignored_rows():
    hidden, weight, labels = _data(4, 16, 333, torch.float32)
    labels.fill_(IGNORE)
    with kernels.backend("triton"):
        loss = kernels.fused_linear_cross_entropy(hidden, weight, labels)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    assert loss.item() == 0.0
    assert not gh.any() and not gw.any()


def test_no_grad_mode_computes_loss_only():
    hidden, weight, labels = _data(5, 16, 333, torch.float32)
    with torch.no_grad(), kernels.backend("triton"):
        loss = kernels.fused_linear_cross_entropy(hidden, weight, labels, 5.0)
    assert loss.grad_fn is None
    torch.testing.assert_close(
        loss, kernels.linear_cross_entropy_reference(hidden, weight, labels, 5.0).detach(),
        rtol=1e-5, atol=1e-4)
