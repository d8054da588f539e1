"""The fused layer follows the layer's roles: Gemma 3's attention-out and MLP-out norms, (1 + w)
norms and q/k norms, query_pre_attn_scalar, per-layer-type RoPE and windows give the loss and
LoRA gradients of plain autograd (fp32 within 1e-5, every keep level, MLP chunks, offload); Phi-4-mini's
partial rotary too; what it does not run (Gemma 2's soft-capping) keeps the layer on the
autograd path, with the same gradients."""

import pytest
import torch
from helpers import BASE, check, chunk_options, loss_and_grads, model_for, one_torch_thread, \
    packed_batch  # noqa: F401  (autouse)

from leantune import kernels
from leantune.engine import Engine, LayerPlan, attach, fused_unsupported

GEMMA3 = dict(BASE, model_type="gemma3_text", num_hidden_layers=3, query_pre_attn_scalar=20,
              sliding_window=5, hidden_activation="gelu_pytorch_tanh",
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                               "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                  "rope_theta": 1e6}})
GEMMA2 = dict(BASE, model_type="gemma2", query_pre_attn_scalar=20, sliding_window=5,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)
PHI3 = dict(BASE, model_type="phi3", head_dim=None, hidden_size=64, partial_rotary_factor=0.75)


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_gemma3_fused_layer_matches_autograd(keep):
    model = model_for(GEMMA3)
    assert model.config.norms.attn_out and model.config.embed_scale
    check(model, [LayerPlan(keep=keep)] * 3)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gemma3_mixed_plans_offload_and_mlp_chunks(backend):
    model = model_for(GEMMA3)
    with kernels.backend(backend):
        engine = check(model, [LayerPlan(0, offload=True), None, LayerPlan(2, offload=True)],
                       options=chunk_options(9))
    assert engine.store.offloaded_bytes > 0


@pytest.mark.parametrize("keep", [0, 1, 2])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_partial_rotary_fused_layer_matches_autograd(keep, backend):
    """Phi-4-mini's partial rotary (0.75 of the head): the first dims rotated in place."""
    model = model_for(PHI3)
    assert model.config.rotary_dim == 12
    with kernels.backend(backend):
        check(model, [LayerPlan(keep=keep)] * 3)


@pytest.mark.parametrize("cfg, why", [(GEMMA2, "attention soft-capping")])
def test_what_the_fused_path_does_not_run_falls_back(cfg, why):
    model = model_for(cfg)
    assert Engine().fused_unsupported(model) == why
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    attach(model, [LayerPlan(0)] * 3)
    assert {type(layer.executor).__name__ for layer in model.layers} == {"CheckpointExecutor"}
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    assert fused_unsupported(model.layers[0]) == why
