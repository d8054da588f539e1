"""engine/grad_handoff.GradHandoff: a layer's input-gradient codes reach the layer below only
for that very gradient, unchanged (same memory, shape, strides and version); anything else gets
None, and nothing is held after a take or a clear."""

import torch

from leantune.engine.grad_handoff import GradHandoff
from leantune.kernels.fp8_quant import QuantizedRows


def _given(n=32, h=256):
    dx = torch.randn(n, h)
    q = QuantizedRows.empty(dx)
    hand = GradHandoff()
    hand.give(dx, q)
    return hand, dx, q


def test_the_same_gradient_gets_its_codes():
    hand, dx, q = _given()
    got = hand.take(dx.view(4, 8, 256).reshape(32, 256))  # (a view: autograd's reshape)
    assert got is not None and got.x.data_ptr() == dx.data_ptr()
    assert got.codes is q.codes and got.scale_t is q.scale_t
    assert not hand.holding and hand.take(dx) is None  # taken once


def test_a_changed_or_other_gradient_gets_none():
    hand, dx, _ = _given()
    dx.add_(1)  # written in place after the codes were made: stale codes
    assert hand.take(dx) is None and not hand.holding
    hand, dx, _ = _given()
    assert hand.take(dx.clone()) is None  # another tensor (e.g. a hook's sum)
    hand, dx, _ = _given()
    assert hand.take(dx[:16]) is None  # another shape
    hand, dx, _ = _given()
    assert hand.take(dx.t().contiguous().t()) is None  # other strides, other memory


def test_clear_and_give_drop_the_held_one():
    hand, dx, q = _given()
    hand.clear()
    assert not hand.holding and hand.take(dx) is None
    hand, dx, q = _given()
    dx2 = torch.randn(32, 256)
    hand.give(dx2, QuantizedRows.empty(dx2))
    assert hand.take(dx) is None  # (the first was dropped)
