"""kernels/qkv_grad.qkv_grad: [rope_bwd(d q) | rope_bwd(d k) | d v] in one pass, equal to the
copies and the in-place RoPE backward it replaces (bit for bit, fp32 and bf16), the Triton kernel
in the interpreter and the reference on odd shapes (strided inputs, a strided out, several
documents' positions), with the codes of out equal to quantize_rows(out) for heads of 128 and
256; wrong shapes and head sizes without whole blocks are one-line errors."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.kernels.fp8_quant import QuantizedRows, quantize_rows_reference
from leantune.kernels.qkv_grad import qkv_grad
from leantune.kernels.rope import rope_


def _inputs(B, T, Hq, Hk, D, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def heads(H):  # a strided view: every other head of a wider tensor
        return (torch.randn(B, T, 2 * H, D, generator=g) * 2).to(dtype)[:, :, ::2]

    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3][:T]] * B)  # (positions restart: packed documents)
    inv = 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D))
    ang = pos[..., None].float() * inv
    ang = torch.cat([ang, ang], -1)
    return heads(Hq), heads(Hk), heads(Hk), ang.cos().to(dtype), ang.sin().to(dtype)


def _by_hand(dq, dk, dv, cos, sin):
    """What the layer backward did before: copies into one buffer, RoPE's backward in place."""
    B, T, Hq, D = dq.shape
    Hk = dk.shape[2]
    out = torch.empty(B * T, (Hq + 2 * Hk) * D, dtype=dq.dtype)
    parts = out.split([Hq * D, Hk * D, Hk * D], 1)
    for dst, src in zip(parts, (dq, dk, dv)):
        dst.view(B, T, -1, D).copy_(src)
    rope_(parts[0].view(B, T, Hq, D), parts[1].view(B, T, Hk, D), cos, sin, inverse=True)
    return out


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("Hq,Hk,D,codes", [(3, 1, 128, True), (6, 2, 64, False),
                                           (2, 1, 256, True), (5, 5, 32, False)])
def test_equals_the_copies_and_rope_backward(Hq, Hk, D, codes, dtype, backend):
    B, T = 2, 7
    dq, dk, dv, cos, sin = _inputs(B, T, Hq, Hk, D, dtype)
    W = (Hq + 2 * Hk) * D
    with kernels.backend(backend):
        want = _by_hand(dq, dk, dv, cos, sin)
        wide = torch.zeros(B * T, W + 8, dtype=dtype)  # out: a strided column slice
        q = QuantizedRows.empty(wide[:, :W]) if codes else None
        got = qkv_grad(dq, dk, dv, cos, sin, wide[:, :W], quant=q.targets if q else None)
    assert got.data_ptr() == wide.data_ptr() and torch.all(wide[:, W:] == 0)
    assert torch.equal(got, want)
    if codes:
        ref_codes, ref_scales = quantize_rows_reference(got)
        assert torch.equal(q.targets[0].view(torch.uint8), ref_codes.view(torch.uint8))
        assert torch.equal(q.targets[1], ref_scales)


def test_refusals_are_one_line():
    dq, dk, dv, cos, sin = _inputs(1, 3, 2, 1, 64, torch.float32)
    out = torch.empty(3, 4 * 64)
    with pytest.raises(ValueError, match="qkv_grad: codes need heads of 128 or 256"):
        qkv_grad(dq, dk, dv, cos, sin, out, quant=QuantizedRows.empty(out).targets)
    with pytest.raises(ValueError, match="do not fit"):
        qkv_grad(dq, dk, dv, cos, sin, torch.empty(3, 5 * 64))
    with pytest.raises(ValueError, match="do not fit"):
        qkv_grad(dq, dk, dv, cos[..., :32], sin[..., :32], out)  # partial rotary tables
