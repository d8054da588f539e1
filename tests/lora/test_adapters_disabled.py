"""adapters_disabled (the preference objectives' reference model): the base alone. Under no_grad a
switched-off LoRALinear skips its rank-r products, so its output is the base's bit for bit (and
an adapter holding inf/NaN cannot leak into it); with gradients on, the adapter still takes part
(scaled by 0), so its parameters get their (zero) gradients."""

import torch
import torch.nn.functional as F

from leantune.lora import adapters_disabled
from leantune.lora.layer import LoRALinear


def _layer(seed=0):
    torch.manual_seed(seed)
    m = LoRALinear(24, 40, bias=True)
    torch.nn.init.normal_(m.weight)
    torch.nn.init.normal_(m.bias)
    m.weight.requires_grad_(False)
    m.add_lora(r=4, alpha=8)
    torch.nn.init.normal_(m.lora_B.weight)
    return m


def test_no_grad_reference_is_the_base_exactly():
    m = _layer()
    x = torch.randn(7, 24)
    with torch.no_grad():
        on = m(x)
        with adapters_disabled(m):
            off = m(x)
            m.lora_B.weight.fill_(float("nan"))  # never read while switched off
            off_nan = m(x)
    ref = F.linear(x, m.base_weight(), m.bias)
    assert torch.equal(off, ref) and torch.equal(off_nan, ref)
    assert not torch.allclose(on, ref)
    assert m.scaling == 2.0  # restored


def test_with_grad_the_adapter_still_gets_gradients():
    m = _layer()
    x = torch.randn(5, 24)
    with adapters_disabled(m):
        y = m(x)
    y.sum().backward()
    assert m.lora_B.weight.grad is not None
    torch.testing.assert_close(y, F.linear(x, m.base_weight(), m.bias))
