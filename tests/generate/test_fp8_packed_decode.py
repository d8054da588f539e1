"""Packed FP8 decoding (generate/projections.py `_PackedFP8`): quantize_fp8_ stacks each layer's
q/k/v and gate/up codes into one storage (the members' FP8Weights row-slice views of it, which
the per-projection GEMMs and training still read), and the "packed" decode step runs each group
as one FP8 product (the GEMV on a step) with the LoRA term as its residual: the same logits and
tokens as one product a projection (LEANTUNE_FP8_PACKED_DECODE=0, or mode "plain")."""

from __future__ import annotations

import pytest
import torch
from helpers import BASE, model_for, one_document_batch, one_torch_thread  # noqa: F401
from test_grpo_gen_projections import step_logits

import leantune
from leantune import kernels
from leantune.engine.weights import layer_groups
from leantune.generate.projections import DecodeProjections
from leantune.kernels import fp8_gemv as gemv
from leantune.kernels.fp8 import FP8View, FP8Weight
from leantune.lora.base_weight import quantize_fp8_

# q/k/v 128 rows each, gate/up 128 (multiples of 128: the block scales slice on rows);
# hidden 72 (its 128-block ends part-way)
FP8_CFG = dict(BASE, model_type="llama", hidden_size=72, num_attention_heads=4,
               num_key_value_heads=4, head_dim=32, intermediate_size=128, num_hidden_layers=2)


def fp8_model(family="llama", lora=True, seed=0):
    cfg = dict(FP8_CFG, model_type=family)
    model = model_for(cfg, seed=seed) if lora else model_for(cfg, targets=["o_proj"], seed=seed)
    if not lora:  # a plain base (only o adapted, with B = 0: the base's own output)
        for layer in model.layers:
            layer.self_attn.o_proj.lora_B.weight.data.zero_()
    return quantize_fp8_(model).eval()


def test_quantize_fp8_stacks_groups_into_views_that_training_reads():
    model = fp8_model()
    for layer in model.layers:
        qkv, o, gu, down = layer_groups(layer)
        for mods in (qkv, gu):
            parts = [(m.fp8.data, m.fp8.scale) for m in mods]
            shape = (sum(m.out_features for m in mods), mods[0].in_features)
            assert FP8View.over(parts, shape, torch.float32) is not None
    # the codes are those of quantising each weight alone
    ref = model_for(dict(FP8_CFG))
    q = ref.layers[0].self_attn.k_proj
    alone = FP8Weight(tuple(q.weight.shape), torch.float32).quantize_(q.weight)
    got = model.layers[0].self_attn.k_proj.fp8
    assert torch.equal(got.data.float(), alone.data.float())
    assert torch.equal(got.scale, alone.scale)
    # training through the views: the gradients of a model with its own buffers per projection
    split = fp8_model()
    for layer in split.layers:
        for mods in layer_groups(layer):
            for m in mods:
                m.fp8.data, m.fp8.scale = m.fp8.data.clone(), m.fp8.scale.clone()
    batch = one_document_batch()
    grads = []
    for m in (model.train(), split.train()):
        m.loss_sum(batch).backward()
        grads.append([p.grad for p in m.parameters() if p.requires_grad])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("family,lora", [("llama", True), ("qwen2", True), ("llama", False)])
def test_packed_fp8_steps_equal_per_projection_steps(monkeypatch, family, lora):
    """The emulated FP8 products (CPU), LoRA on every projection / q/k/v bias / no adapter
    (the 16-bit LM head in both)."""
    monkeypatch.setenv("LEANTUNE_FP8_DECODE_HEAD", "0")
    model = fp8_model(family, lora)
    ref = step_logits(model, "plain")
    proj = DecodeProjections(model, "packed")
    assert proj.packed_groups == 2 * len(model.layers)
    # q, k, v, the MLP (gate/up + down's own forward) and o (adapted in both), down (adapted
    # with lora): o and down as one-member products
    assert len(proj.forwards) == (5 + lora) * len(model.layers)
    for a, b in zip(step_logits(model, "packed"), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("LEANTUNE_FP8_PACKED_DECODE", "0")  # the switch: one product a projection
    assert DecodeProjections(model, "packed").packed_groups == 0
    for a, b in zip(step_logits(model, "packed"), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.fixture
def gemv_rows(monkeypatch):
    """The output rows of each Triton GEMV call (LEANTUNE_FP8_GEMV=1: every product of <= 16
    rows takes it), in call order."""
    seen, real = [], gemv.fp8_gemv

    def counted(x, w, *args, **kw):
        seen.append(w.shape[0])
        return real(x, w, *args, **kw)

    monkeypatch.setattr(gemv, "fp8_gemv", counted)
    monkeypatch.setenv("LEANTUNE_FP8_GEMV", "1")
    return seen


def test_generate_runs_one_gemv_a_group(monkeypatch, gemv_rows):
    """leantune.generate through the Triton GEMV (interpreter): 4 GEMVs a layer (q/k/v, o,
    gate/up, down) instead of 7, the same greedy tokens."""
    monkeypatch.setenv("LEANTUNE_FP8_DECODE_HEAD", "0")  # (the head: the next test)
    model = fp8_model()
    tokens, per_layer, layer0 = {}, {"1": 4, "0": 7}, {}
    for packed in ("1", "0"):
        monkeypatch.setenv("LEANTUNE_FP8_PACKED_DECODE", packed)
        gemv_rows.clear()
        with kernels.backend("triton"):
            tokens[packed] = [g.token_ids for g in leantune.generate(
                model, None, [[3, 17, 5, 60, 2], [9, 9, 41]], max_new_tokens=2,
                eos_token_ids=[], cuda_graphs=False)]
        assert len(gemv_rows) == per_layer[packed] * len(model.layers) * 2  # prefill + 1 step
        layer0[packed] = gemv_rows[:per_layer[packed]]
    assert layer0 == {"1": [384, 72, 256, 72],  # q/k/v, o, gate/up, down
                      "0": [128, 128, 128, 72, 128, 128, 72]}  # one a projection
    assert tokens["1"] == tokens["0"]


def test_fp8_head_decodes_as_the_dequantised_head(monkeypatch, gemv_rows):
    """Under FP8 projections the decode steps' logits come from an e4m3 copy of the LM head
    (the GEMV, x unquantised): the tokens and step logits of the same model whose 16-bit head
    holds that copy's dequantised values; re-quantised after the head changes; off with
    LEANTUNE_FP8_DECODE_HEAD=0 and for a tied head."""
    from leantune.generate.projections import _HEADS

    model = fp8_model()
    dense_head = fp8_model()
    head = DecodeProjections(model).head
    assert head is not None and model in _HEADS
    with torch.no_grad():
        dense_head.lm_head.weight.copy_(head.q.dequantize(dtype=torch.float32))
    with kernels.backend("triton"):
        got = step_logits(model, "packed", steps=1)
        monkeypatch.setenv("LEANTUNE_FP8_DECODE_HEAD", "0")
        assert DecodeProjections(dense_head).head is None
        want = step_logits(dense_head, "packed", steps=1)
    assert len(gemv_rows) and 97 in gemv_rows  # the head's 97 rows through the GEMV
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert [t.argmax(-1).tolist() for t in got] == [t.argmax(-1).tolist() for t in want]
    monkeypatch.delenv("LEANTUNE_FP8_DECODE_HEAD")
    old = head.q.data.clone()
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # (in place, as an optimizer step)
    DecodeProjections(model).refresh()
    assert torch.equal(head.q.data.view(torch.uint8), old.view(torch.uint8))  # (codes: scaled)
    torch.testing.assert_close(head.q.scale, 2 * dense_head_scale(dense_head, head))
    tied = quantize_fp8_(model_for(dict(FP8_CFG, tie_word_embeddings=True))).eval()
    assert DecodeProjections(tied).head is None


def dense_head_scale(dense_head, head):
    """The block scales of quantising dense_head's (dequantised) head again: those of head."""
    w = dense_head.lm_head.weight
    return FP8Weight(tuple(w.shape), torch.float32).quantize_(w).scale


def test_decode_stacks_groups_loaded_apart():
    """A model whose FP8 buffers have storage of their own each (loaded from meta: to_empty
    allocates buffer by buffer) gets its groups stacked by the first decode step, the codes
    unchanged: the members' buffers become views of one (no copy kept)."""
    model = fp8_model()
    qkv = layer_groups(model.layers[0])[0]
    before = [m.fp8.data.float().clone() for m in qkv]
    for layer in model.layers:
        for mods in layer_groups(layer):
            for m in mods:
                m.fp8.data, m.fp8.scale = m.fp8.data.clone(), m.fp8.scale.clone()
    shape = (sum(m.out_features for m in qkv), qkv[0].in_features)
    assert FP8View.over([(m.fp8.data, m.fp8.scale) for m in qkv], shape, torch.float32) is None
    assert DecodeProjections(model).packed_groups == 2 * len(model.layers)
    view = FP8View.over([(m.fp8.data, m.fp8.scale) for m in qkv], shape, torch.float32)
    assert view is not None and view.data.data_ptr() == qkv[0].fp8.data.data_ptr()
    assert all(torch.equal(m.fp8.data.float(), b) for m, b in zip(qkv, before))
