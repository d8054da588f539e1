"""The fused layers on a 4-bit (NF4) base: the weight provider dequantises into scratch buffers
of the packed shapes (one per shape, shared by every layer; LoRA columns written at each fill),
and the loss and LoRA gradients equal plain autograd's over the same 4-bit weights, for every
keep level, packed or not, in MLP row chunks, through Triton (interpreter) and the reference."""

import pytest
import torch

from helpers import CONFIGS, check, chunk_options, model_for
from leantune import kernels
from leantune.engine import Engine, EngineOptions, LayerPlan
from leantune.kernels.nf4 import NF4Weight
from leantune.model.loader import nf4_projections, quantize_nf4_

PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]


def nf4_model(family="llama", **kw):
    return quantize_nf4_(model_for(CONFIGS[family], **kw))


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_fused_layers_on_nf4_match_autograd(family, backend):
    model = nf4_model(family)
    assert all(m.nf4 is not None for _, m in nf4_projections(model))
    with kernels.backend(backend):
        engine = check(model, PLANS)
    # packed q/k/v, gate/up and down, o unpacked: four shapes, whatever the layer count
    shapes = {key[0] for key in engine.weights.scratch.buffers}
    assert len(shapes) == 4 and (40, 48) in shapes  # o: [hidden, heads * head_dim]


@pytest.mark.parametrize("options", [EngineOptions(pack_projections=False),
                                     EngineOptions(pack_lora=False), chunk_options(9)],
                         ids=["unpacked", "packed-without-lora-columns", "mlp-chunks"])
def test_nf4_layouts_match_autograd(options):
    check(nf4_model(), [LayerPlan(0), LayerPlan(1), LayerPlan(2)], options=options)


def test_groups_mixing_4bit_and_16bit_weights():
    """A checkpoint may keep some projections 16-bit (llm_int8_skip_modules): their weights are
    copied into the group's scratch buffer; partial LoRA targets leave zero LoRA columns."""
    model = model_for(CONFIGS["qwen3"], targets=["q_proj", "up_proj"])
    for name, mod in nf4_projections(model):
        if not name.endswith(("k_proj", "gate_proj")):
            w = mod.weight
            mod.set_nf4_base(NF4Weight(w.shape, w.dtype).quantize_(w))
    check(model, PLANS)


def test_pack_allocates_the_scratch_buffers_a_step_uses():
    """Engine.pack allocates them before memory is measured (the planner's fixed bytes); a step
    allocates no other."""
    model = nf4_model()
    engine = Engine(EngineOptions())
    engine.pack(model)
    before = dict(engine.weights.scratch.buffers)
    assert engine.weights.scratch.nbytes() > 0
    check(model, PLANS, engine=engine)
    assert engine.weights.scratch.buffers.keys() == before.keys()
    assert all(engine.weights.scratch.buffers[k] is before[k] for k in before)


def test_backward_dequantises_again_except_the_last_layer(monkeypatch):
    """No 16-bit weight is kept from forward to backward: each layer's backward dequantises its
    7 weights again, except the last layer's, which are still in the buffers, and the first
    layer's q/k/v (no input gradient: its input is the frozen embedding)."""
    from helpers import loss_and_grads, packed_batch

    model = nf4_model()
    engine = Engine(EngineOptions())
    engine.attach(model, [LayerPlan(2)] * 3)
    calls = []
    real = NF4Weight.dequantize
    monkeypatch.setattr(NF4Weight, "dequantize",
                        lambda self, *a, **kw: calls.append(self) or real(self, *a, **kw))
    batch = packed_batch()
    loss = model.loss_sum(batch)
    forward = len(calls)
    loss.backward()
    assert forward == 7 * 3
    assert len(calls) - forward == 7 + 4
    loss_and_grads(model, batch)  # a second step fills every buffer again
    assert len(calls) == 2 * (21 + 11)
