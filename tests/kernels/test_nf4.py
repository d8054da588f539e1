"""NF4 in bitsandbytes' layout: the quantiser stays within NF4's error bound, the Triton
dequantiser (interpreter) equals the reference bit for bit, both equal bitsandbytes' own
dequantisation (where it is installed), and the container keeps its format through `.to()`."""

import pytest
import torch

from helpers import one_torch_thread  # noqa: F401  (autouse)
from leantune import kernels
from leantune.errors import LeantuneError
from leantune.kernels.nf4 import (NF4_LEVELS, NF4Weight, dequantize_nf4,
                                  dequantize_nf4_reference, dynamic_map, nf4_linear,
                                  parse_bnb_state)

# odd shapes: blocks of 64 straddle rows, an odd value count pads the last byte, absmax blocks
# of 256 end part-way
SHAPES = [(7, 37), (33, 64), (5, 200), (130, 129)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, :3] = 0.3  # an outlier: one block's absmax well above the rest
    return w.to(dtype)


def _error_bound(w: torch.Tensor, q: NF4Weight) -> torch.Tensor:
    """Per value, how far NF4 may be off: the level rounding (half the widest gap between
    levels, times the block's true absmax), plus the stored absmax's error (times |level| <= 1),
    plus the rounding to the weight's dtype."""
    gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:])) / 2
    flat = w.float().reshape(-1)
    n = flat.numel()
    true = torch.cat([flat, flat.new_zeros(-n % 64)]).view(-1, 64).abs().amax(1)
    stored = q.absmax_fp32()
    per_block = true * gap + (stored - true).abs() + stored.abs() * torch.finfo(w.dtype).eps
    return per_block.repeat_interleave(64)[:n].view(w.shape) + 1e-12


def test_dynamic_map():
    m = dynamic_map()
    assert m.shape == (256,) and m.dtype == torch.float32
    assert torch.all(m[1:] > m[:-1])  # sorted, no repeats
    assert m[-1] == 1.0 and (m == 0).sum() == 1 and m[0] > -1.0 and m.abs().min() == 0


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nested", [True, False])
def test_quantize_dequantize_within_nf4_error(shape, dtype, nested):
    w = _weight(shape, dtype)
    q = NF4Weight(shape, dtype, nested=nested).quantize_(w)
    assert q.packed.numel() == -(-w.numel() // 2) and q.absmax.numel() == -(-w.numel() // 64)
    back = dequantize_nf4_reference(q)
    assert back.dtype == dtype and back.shape == shape
    err = (back.float() - w.float()).abs()
    assert torch.all(err <= _error_bound(w, q)), (err - _error_bound(w, q)).max()
    assert err.max() > 0  # 4 bits are not exact: the test compares something
    if w.numel() % 2:
        assert q.packed[-1] & 15 == 7  # the pad is the level 0.0, as bitsandbytes pads


def test_zero_blocks_and_constant_weights():
    w = torch.zeros(3, 128)
    w[1] = 0.5
    q = NF4Weight(w.shape, torch.float32).quantize_(w)
    back = dequantize_nf4_reference(q)
    assert torch.equal(back[0], torch.zeros(128)) and torch.equal(back[2], torch.zeros(128))
    assert torch.allclose(back[1], w[1], rtol=0.01)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("wdtype", DTYPES)
@pytest.mark.parametrize("out_dtype", DTYPES)
def test_triton_dequantize_equals_reference(shape, wdtype, out_dtype):
    """Bit for bit, into a strided view (the left columns of a wider buffer, as the engine's
    packed scratch buffer), nested statistics or not."""
    for nested in (True, False):
        q = NF4Weight(shape, wdtype, nested=nested).quantize_(_weight(shape, wdtype, seed=1))
        wide = torch.full((shape[0], shape[1] + 9), 7.0, dtype=out_dtype)
        dequantize_nf4(q, wide[:, 2:2 + shape[1]])
        assert torch.equal(wide[:, 2:2 + shape[1]], dequantize_nf4_reference(q, out_dtype))
        assert torch.all(wide[:, :2] == 7) and torch.all(wide[:, 2 + shape[1]:] == 7)


def test_dequantize_picks_the_kernel_by_backend():
    q = NF4Weight((9, 70), torch.bfloat16).quantize_(_weight((9, 70), torch.bfloat16))
    ref = dequantize_nf4_reference(q)
    with kernels.backend("triton"):
        assert torch.equal(q.dequantize(), ref)
    with kernels.backend("reference"):
        out = torch.empty(9, 70, dtype=torch.float32)
        assert q.dequantize(out=out) is out and torch.equal(out, ref.float())
    with pytest.raises(ValueError, match="shape"):
        q.dequantize(out=torch.empty(70, 9))


def test_to_moves_but_keeps_the_format():
    q = NF4Weight((8, 64), torch.float32).quantize_(_weight((8, 64), torch.float32))
    before = dequantize_nf4_reference(q, torch.float32)
    q.to(torch.bfloat16)
    assert q.dtype == torch.bfloat16  # the compute dtype follows the model
    assert q.nested_absmax.dtype == q.nested_quant_map.dtype == torch.float32
    assert q.weight_dtype == torch.float32 and q.absmax.dtype == torch.uint8
    assert torch.equal(dequantize_nf4_reference(q, torch.float32), before)
    assert q.dequantize().dtype == torch.bfloat16
    assert set(q.state_dict()) == {"packed", "quant_map", "absmax", "nested_absmax",
                                   "nested_quant_map", "nested_offset"}


def test_nf4_linear_dequantises_in_forward_and_backward():
    q = NF4Weight((24, 64), torch.float32).quantize_(_weight((24, 64), torch.float32))
    w = dequantize_nf4_reference(q)
    x = torch.randn(2, 5, 64, requires_grad=True)
    dy = torch.randn(2, 5, 24)
    y = nf4_linear(x, q)
    (dx,) = torch.autograd.grad(y, x, dy)
    x2 = x.detach().requires_grad_()
    y2 = torch.nn.functional.linear(x2, w)
    (dx2,) = torch.autograd.grad(y2, x2, dy)
    torch.testing.assert_close(y, y2, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx2, rtol=1e-6, atol=1e-6)


def _state(**kw):
    import json

    d = {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [8, 64],
         "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.1, **kw}
    return torch.tensor(list(json.dumps(d).encode()), dtype=torch.uint8)


@pytest.mark.parametrize("name,state,match", [
    ("w.weight.quant_state.bitsandbytes__fp4", _state(quant_type="fp4"), "fp4 4-bit weights"),
    ("w.weight.quant_state.bitsandbytes__nf4", _state(blocksize=128), "blocksize 128"),
    ("w.weight.quant_state.bitsandbytes__nf4", _state(nested_blocksize=128), "blocks of 64"),
    ("w.weight.quant_state.bitsandbytes__nf4", _state(shape=[2, 4, 64]), "2-D weights"),
    ("w.weight.quant_state.bitsandbytes__nf4", torch.tensor([1, 2, 3], dtype=torch.uint8),
     "unreadable"),
])
def test_quant_states_leantune_does_not_read_are_one_line_errors(name, state, match):
    with pytest.raises(LeantuneError, match=match) as e:
        parse_bnb_state(state, name)
    assert name in str(e.value) and "\n" not in str(e.value)


def test_bnb_tensors_are_checked_on_load():
    q = NF4Weight((8, 64), torch.bfloat16)
    with pytest.raises(LeantuneError, match="quant_storage other than uint8"):
        q.load_bnb_("", torch.zeros(128, 1, dtype=torch.bfloat16), "x.weight")
    with pytest.raises(LeantuneError, match="expected 8 values"):
        q.load_bnb_("absmax", torch.zeros(9, dtype=torch.uint8), "x.weight.absmax")
    with pytest.raises(LeantuneError, match="not the NF4 levels"):
        q.load_bnb_("quant_map", torch.linspace(-1, 1, 16), "x.weight.quant_map")
    q.load_bnb_("quant_state.bitsandbytes__nf4", _state(nested_offset=0.25),
                "x.weight.quant_state.bitsandbytes__nf4")
    assert q.nested_offset.item() == 0.25


# --- against bitsandbytes itself (its CPU backend, >= 0.47) --------------------------------------
@pytest.fixture(scope="module")
def bnb():
    return pytest.importorskip("bitsandbytes.functional")


def test_dynamic_map_is_bitsandbytes(bnb):
    assert torch.equal(dynamic_map(), bnb.create_dynamic_map())


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_equals_bitsandbytes_bit_for_bit(bnb, shape, dtype):
    """bitsandbytes quantises; ours dequantises its tensors (loaded as from a checkpoint)."""
    w = _weight(shape, dtype, seed=2)
    for nested in (True, False):
        packed, st = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4",
                                       compress_statistics=nested)
        q = NF4Weight(shape, dtype, nested=nested)
        q.load_bnb_("", packed, "w")
        for part, t in st.as_dict(packed=True).items():
            q.load_bnb_(part, t, f"w.{part}")
        want = bnb.dequantize_4bit(packed, st)
        assert torch.equal(dequantize_nf4_reference(q, dtype), want)
        out = torch.empty(shape, dtype=torch.float32)
        assert torch.equal(dequantize_nf4(q, out), want.float())


@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_agrees_with_bitsandbytes(bnb, dtype):
    """The same 4-bit codes and nested scales; the 8-bit absmax codes are the nearest (where
    bitsandbytes' search picks a neighbour, rarely, ours is never further from the true
    absmax)."""
    shape = (96, 1024)
    w = _weight(shape, dtype, seed=3)
    packed, st = bnb.quantize_4bit(w, blocksize=64, quant_type="nf4", compress_statistics=True)
    ours = NF4Weight(shape, dtype).quantize_(w)
    assert torch.equal(ours.packed, packed.view(-1))
    assert torch.equal(ours.nested_absmax, st.state2.absmax)
    assert torch.allclose(ours.nested_offset, st.offset, rtol=1e-6)
    assert (ours.absmax == st.absmax).float().mean() > 0.99
    true = w.float().view(-1, 64).abs().amax(1)
    theirs = NF4Weight(shape, dtype)
    theirs.load_state_dict({**ours.state_dict(), "absmax": st.absmax})
    assert torch.all((ours.absmax_fp32() - true).abs() <= (theirs.absmax_fp32() - true).abs())
