"""The base weight as one object (lora/base_weight.py): dense, NF4 and FP8 bases give their GEMMs
(mm: x W^T, mm_t: dy W, with a residual / accumulation), their dense value and their bytes;
LoRALinear computes through them (forward and backward), and the engine's unpacked projection
group runs an FP8 base's GEMMs through the Triton kernel (interpreter) as through the emulation."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.engine.options import EngineOptions
from leantune.engine.projections import ProjectionGroup
from leantune.engine.weights import DenseWeights
from leantune.kernels.fp8 import FP8Weight, fp8_mm_reference
from leantune.kernels.nf4 import NF4Weight
from leantune.lora.base_weight import DenseBase, FP8Base, NF4Base, wrap
from leantune.lora.layer import LoRALinear

OUT, IN = 45, 150


def _bases():
    w = torch.randn(OUT, IN) * 0.05
    return w, [DenseBase(w), NF4Base(NF4Weight(w.shape, w.dtype).quantize_(w)),
               FP8Base(FP8Weight(w.shape, w.dtype).quantize_(w))]


def test_kinds_flags_and_bytes():
    w, (dense, nf4, fp8) = _bases()
    assert [b.kind for b in (dense, nf4, fp8)] == ["dense", "nf4", "fp8"]
    assert not dense.quantized and nf4.quantized and fp8.quantized
    assert dense.packable and dense.lora_columns
    assert not (fp8.packable or fp8.lora_columns)  # the adapter stays out of the FP8 codes
    assert dense.nbytes == OUT * IN * 4
    assert fp8.nbytes == OUT * IN + 2 * 4  # one byte a weight + 1 x 2 block scales
    assert nf4.nbytes < OUT * IN  # ~0.5 byte a weight
    assert all(b.shape == (OUT, IN) and b.dtype == torch.float32 for b in (dense, nf4, fp8))
    assert isinstance(wrap(fp8.store), FP8Base) and isinstance(wrap(w), DenseBase)


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["dense", "nf4", "fp8"])
def test_gemms(kind):
    base = _bases()[1][kind]
    x, dy = torch.randn(7, IN), torch.randn(7, OUT)
    resid, acc = torch.randn(7, OUT), torch.randn(7, IN)
    if base.kind == "fp8":
        want_y, want_dx = fp8_mm_reference(x, base.store), fp8_mm_reference(dy, base.store, True)
    else:
        w = base.dequantize()
        want_y, want_dx = x @ w.t(), dy @ w
    torch.testing.assert_close(base.mm(x), want_y)
    torch.testing.assert_close(base.mm(x, resid=resid), want_y + resid)
    torch.testing.assert_close(base.mm_t(dy), want_dx)
    got = acc.clone()
    base.mm_t(dy, out=got, accumulate=True)
    torch.testing.assert_close(got, acc + want_dx)
    out = torch.empty(7, OUT)
    assert base.mm(x, out=out) is out


def test_lora_linear_on_an_fp8_base_forward_and_backward():
    """y = fp8(x W^T) + b + s x A^T B^T, dx = fp8(dy W) + s dy B A: the plain path's Function
    (base_linear) against the same math in autograd ops."""
    torch.manual_seed(0)
    layer = LoRALinear(IN, OUT, bias=True)
    torch.nn.init.normal_(layer.weight, std=0.05)
    torch.nn.init.normal_(layer.bias)
    w = layer.weight.detach().clone()
    layer.set_quantized_base(FP8Weight(w.shape, w.dtype).quantize_(w))
    assert layer.weight is None and layer.nf4 is None and layer.fp8 is not None
    assert "fp8" in repr(layer) and isinstance(layer.base, FP8Base)
    layer.add_lora(4, 8.0)
    torch.nn.init.normal_(layer.lora_B.weight)
    x = torch.randn(2, 5, IN, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    q = layer.fp8
    a, b, s = layer.lora_A.weight, layer.lora_B.weight, layer.scaling
    x2, dy2 = x.detach().reshape(-1, IN), dy.reshape(-1, OUT)
    want = fp8_mm_reference(x2, q) + layer.bias + s * (x2 @ a.t()) @ b.t()
    torch.testing.assert_close(y.detach().reshape(-1, OUT), want)
    want_dx = fp8_mm_reference(dy2, q, transpose=True) + s * (dy2 @ b) @ a
    torch.testing.assert_close(x.grad.reshape(-1, IN), want_dx)
    torch.testing.assert_close(layer.lora_B.weight.grad, s * dy2.t() @ (x2 @ a.t()))
    torch.testing.assert_close(layer.base_weight(), q.dequantize())


def test_quantized_base_of_the_wrong_shape_is_refused():
    layer = LoRALinear(IN, OUT)
    with pytest.raises(ValueError, match="FP8Weight of shape"):
        layer.set_quantized_base(FP8Weight((OUT, IN + 1), torch.float32))


@pytest.mark.parametrize("outs", [(40, 24, 24), (128, 128, 256)], ids=["unpacked", "packed"])
def test_projection_group_on_fp8_through_triton_equals_emulation(outs):
    """q/k/v-like group (three projections, one input, one with LoRA): the FP8 source runs it
    packed (one GEMM each way) where every output is a multiple of 128, else unpacked; forward
    and input gradient through the kernel equal the emulation."""
    torch.manual_seed(0)
    mods = []
    for out_f in outs:
        m = LoRALinear(IN, out_f)
        torch.nn.init.normal_(m.weight, std=0.05)
        m.set_quantized_base(FP8Weight(m.weight.shape, torch.float32).quantize_(m.weight))
        mods.append(m)
    mods[0].add_lora(4, 4.0)
    torch.nn.init.normal_(mods[0].lora_B.weight)
    x, dys = torch.randn(11, IN), torch.randn(11, sum(outs))
    results = []
    for backend in ("triton", "reference"):
        with kernels.backend(backend):
            group = ProjectionGroup(mods, torch.float32, DenseWeights(EngineOptions()), pack=True)
            assert group.packed == (outs[0] == 128)
            X = group.new_input(11, x)
            X[:, :IN] = x
            group.fill_lora(X)
            y = group.project(X)
            dx, ga = group.input_grad(dys)
            results.append((y, dx, ga))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
