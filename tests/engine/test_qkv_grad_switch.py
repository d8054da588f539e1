"""EngineOptions.fuse_qkv_grad: the layer backward assembles d q | d k | d v through RoPE's
backward in one pass (kernels/qkv_grad.py) instead of three copies and an in-place RoPE pass.
On and off give bit-identical loss and LoRA gradients (fp32, CPU, both kernel backends, keep
levels with offload; q/k/v biases, sliding windows, Gemma 2's scaling), the fused layers still
equal plain autograd, and layers it does not cover (q/k norms, partial rotary) keep their own
pass."""

import pytest
import torch

from helpers import CONFIGS, GEMMA2_NO_SOFTCAP, check, engine_loss_and_grads, model_for
from leantune.engine import EngineOptions, LayerPlan
from leantune.engine import executor as executor_module

PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]
FAMILIES = {"llama": CONFIGS["llama"], "qwen2": CONFIGS["qwen2"],
            "mistral": CONFIGS["mistral"], "gemma2": GEMMA2_NO_SOFTCAP,
            "qwen3": CONFIGS["qwen3"],  # q/k norm: not covered
            "partial": dict(CONFIGS["llama"], model_type="phi3",  # rotary over part of a head
                            partial_rotary_factor=0.5)}
COVERED = {"llama", "qwen2", "mistral", "gemma2"}


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_on_and_off_agree(family, backend, monkeypatch):
    calls = []
    real = executor_module.qkv_grad
    monkeypatch.setattr(executor_module, "qkv_grad",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    model = model_for(FAMILIES[family])
    loss_on, grads_on = engine_loss_and_grads(model, backend, PLANS, fuse_qkv_grad=True)
    on_calls = len(calls)
    loss_off, grads_off = engine_loss_and_grads(model, backend, PLANS, fuse_qkv_grad=False)
    assert torch.equal(loss_on, loss_off)
    assert all(torch.equal(a, b) for a, b in zip(grads_on, grads_off))
    # one call a layer's backward where covered, none where not, none with the switch off
    assert on_calls == (len(PLANS) if family in COVERED else 0) and len(calls) == on_calls


@pytest.mark.parametrize("family", sorted(COVERED))
def test_fused_path_equals_autograd(family):
    check(model_for(FAMILIES[family]), PLANS, options=EngineOptions(fuse_qkv_grad=True))
