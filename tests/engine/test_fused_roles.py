"""The fused layer follows the layer's roles: Gemma 3's attention-out and MLP-out norms, (1 + w)
norms and q/k norms, query_pre_attn_scalar, per-layer-type RoPE and windows give the loss and
LoRA gradients of plain autograd (fp32 within 1e-5, every keep level, MLP chunks, offload); Phi-4-mini's
partial rotary too; Gemma 2's soft-capped attention runs in query blocks with its softmax
statistics kept (no [T, T] scores), forward and backward equal to the whole-scores reference."""

import pytest
import torch
from helpers import BASE, check, chunk_options, model_for, one_torch_thread  # noqa: F401

from leantune import kernels
from leantune.engine import LayerPlan

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


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_gemma2_soft_capped_fused_layer_matches_autograd(keep):
    """Gemma 2: soft-capped attention in query blocks with its log-sum-exp kept
    (model/softcap_attention.py), alternating windows, both out-norms, the final soft-cap in
    the loss."""
    model = model_for(GEMMA2)
    assert model.layers[0].self_attn.softcap == 5.0 and model.config.final_softcap == 3.0
    check(model, [LayerPlan(keep=keep)] * 3)


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("path", ["varlen", "mask", "causal"])
def test_blocked_softcap_attention_equals_the_scores_reference(window, path):
    """Forward and backward of the blocked soft-capped attention (blocks of 4 queries) equal
    autograd through the whole-scores reference, over packed documents (varlen: from
    cu_seqlens; mask: the metadata's masks) and whole rows (causal)."""
    from leantune.model.attention import AttentionMeta, _scores_attention
    from leantune.model.softcap_attention import (softcap_attention_backward,
                                                  softcap_attention_forward)

    g = torch.Generator().manual_seed(0)
    B, T, Hq, Hk, D = 2, 11, 4, 2, 8
    q, k, v, do = (torch.randn(B, T, h, D, generator=g) for h in (Hq, Hk, Hk, Hq))
    lens = [4, 7, 11] if path != "causal" else [11, 11]
    kw = dict(seq_lens=lens, cu_seqlens=None, max_seqlen=11, windows={window})
    meta = AttentionMeta.build((B, T), torch.device("cpu"), path=path, **kw)
    mask_meta = AttentionMeta.build((B, T), torch.device("cpu"), path="mask", **kw)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = _scores_attention(*leaves, mask_meta.masks[window], 0.3, softcap=2.0)
    ref.backward(do)
    out, lse = softcap_attention_forward(q, k, v, meta, window, 0.3, 2.0, block=4)
    torch.testing.assert_close(out, ref.detach(), rtol=1e-5, atol=1e-6)
    grads = softcap_attention_backward(do, q, k, v, out, lse, meta, window, 0.3, 2.0, block=4)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-6)
