"""The fused layer across LoRA target subsets, packing switches, MLP row chunks, biases and
frozen layers (fp32, CPU: against autograd), and what its forward holds in memory."""

import pytest
import torch

from helpers import BASE, CONFIGS, check, chunk_options, model_for
from leantune import kernels
from leantune.engine import EngineOptions, LayerPlan
from leantune.engine import executor as executor_module

BIAS_ALL = dict(BASE, model_type="llama", attention_bias=True, mlp_bias=True)


@pytest.mark.parametrize("targets", [None, ["q_proj", "v_proj"], ["down_proj"],
                                     ["gate_proj"], ["k_proj", "up_proj", "o_proj"]])
@pytest.mark.parametrize("pack_lora,pack", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("chunked", [False, True])
def test_sweep_targets_packing_chunks(targets, pack_lora, pack, chunked):
    switches = dict(pack_lora=pack_lora, pack_projections=pack)
    # chunked: 6 backward chunks, 3 forward chunks over the 48-token batch
    options = chunk_options(9, **switches) if chunked else EngineOptions(**switches)
    model = model_for(BIAS_ALL, targets=targets, rslora=True)
    with kernels.backend("reference"):
        check(model, [LayerPlan(1, offload=True), LayerPlan(2), LayerPlan(1)], options=options)
        check(model, [LayerPlan(0), LayerPlan(2, offload=True), LayerPlan(0, offload=True)],
              options=options)


@pytest.mark.parametrize("align", [1, 7, 64])
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_sweep_triton_chunked_alignments(align, family):
    model = model_for(CONFIGS[family], targets=["q_proj", "v_proj", "down_proj"])
    with kernels.backend("triton"):
        check(model, [LayerPlan(1), LayerPlan(2, offload=True), LayerPlan(1, offload=True)],
              options=chunk_options(9, pack_align=align))


def test_frozen_middle_layer_and_input_grad(monkeypatch):
    """A layer without trainable LoRA between trainable ones still back-propagates dx (in graph
    through its input), and the lowest trainable layer runs with need_dx=False."""
    model = model_for(CONFIGS["llama"])
    for p in model.model.layers[1].parameters():
        p.requires_grad_(False)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    check(model, [LayerPlan(1)] * 3)
    model = model_for(CONFIGS["llama"])
    for p in model.model.layers[1].parameters():
        p.requires_grad_(False)
    check(model, [LayerPlan(2), LayerPlan(1, offload=True), LayerPlan(0)])


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_forward_frees_qkv_input_before_the_mlp(keep, monkeypatch):
    """The q/k/v GEMM's input buffer ([N, H + R + pad]) is gone before the MLP runs (a layer
    that keeps x A^T keeps a copy of those R columns only); a layer that keeps only its input
    has let go of q/k/v too."""
    import weakref

    alive = []
    refs = []
    real_attention = executor_module._LayerRun._attention
    real_glu = executor_module.glu_fwd

    def attention(self, x2, shape, for_backward=False):
        res = real_attention(self, x2, shape, for_backward)
        if not for_backward:
            refs.append((weakref.ref(res[0]), weakref.ref(res[2])))
        return res

    def glu(*a, **kw):
        if refs:
            x1, qkv = refs[-1]
            alive.append((x1() is not None, qkv() is not None))
        return real_glu(*a, **kw)

    monkeypatch.setattr(executor_module._LayerRun, "_attention", attention)
    monkeypatch.setattr(executor_module, "glu_fwd", glu)
    model = model_for(CONFIGS["llama"])
    check(model, [LayerPlan(keep)] * 3)
    assert alive and not any(x1 for x1, _ in alive), alive
    assert all(qkv == (keep > 0) for _, qkv in alive), alive
