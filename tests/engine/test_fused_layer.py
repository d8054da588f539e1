"""The fused decoder layer (hand-written backward, selective recompute, offload) gives the same
loss and LoRA gradients as plain autograd, for every keep level, on and off the "host", with the
MLP in one piece or in row chunks, through Triton (interpreter) and reference ops (fp32, CPU)."""

import pytest
import torch

from helpers import (BASE, CONFIGS, check, chunk_options, loss_and_grads, model_for,
                     one_document_batch, packed_batch)
from leantune import LoRAConfig, apply_lora, kernels
from leantune.engine import Engine, EngineOptions, Keep, LayerPlan, attach, fused_unsupported
from leantune.engine import activation_store as st
from leantune.engine import attention as engine_attention


@pytest.mark.parametrize("family", list(CONFIGS))
@pytest.mark.parametrize("keep", [0, 1, 2])
def test_fused_layer_matches_autograd(family, keep):
    model = model_for(CONFIGS[family])
    check(model, [LayerPlan(keep=keep)] * 3)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_fused_layer_matches_autograd_on_one_document_rows(family):
    model = model_for(CONFIGS[family])
    batch = one_document_batch()
    assert len(batch.seq_lens) == 2  # one document a row
    check(model, [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)], batch=batch)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_mixed_plans_offload_and_mlp_chunks(family, backend):
    # ~9 rows per backward MLP chunk: the 38-token batch runs in 5 chunks (8, 8, 8, 8, 6 rows),
    # in forward in 3 (16, 16, 6; forward chunks are mlp_forward_chunk_factor = 2 times larger)
    model = model_for(CONFIGS[family])
    with kernels.backend(backend):
        engine = check(model, [LayerPlan(0, offload=True), None, LayerPlan(1, offload=True)],
                       options=chunk_options(9))
    assert engine.store.offloaded_bytes > 0


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], ["down_proj"], ["k_proj", "up_proj"]])
def test_partial_lora_targets_and_rslora(targets):
    model = model_for(CONFIGS["llama"], targets=targets, rslora=True)
    check(model, [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)])


def test_fused_switch_off_falls_back_to_checkpoint():
    model = model_for(CONFIGS["llama"])
    engine = check(model, [LayerPlan(0)] * 3, options=EngineOptions(fused_layers=False))
    assert {type(layer.executor).__name__ for layer in model.layers} == {"CheckpointExecutor"}
    assert engine.fused_unsupported(model) == "fused layers switched off"


def test_unsupported_layers_fall_back():
    """LoRA dropout keeps layers off the fused path: they recompute under
    torch.utils.checkpoint instead, with the same gradients (dropout off in eval mode)."""
    model = model_for(CONFIGS["llama"])
    apply_lora(model, LoRAConfig(r=4, alpha=8, dropout=0.1), seed=0)
    assert Engine().fused_unsupported(model) == "LoRA dropout"
    model.eval()  # dropout off: the recompute must give autograd's gradients
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    attach(model, [LayerPlan(0)] * 3)
    assert {type(layer.executor).__name__ for layer in model.layers} == {"CheckpointExecutor"}
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    frozen = model_for(CONFIGS["llama"])
    frozen.model.layers[0].mlp.up_proj.weight.requires_grad_(True)
    assert fused_unsupported(frozen.model.layers[0]).startswith("trainable base weight")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_bf16_as_accurate_as_autograd(family, seed):
    """In bf16 the fused path rounds at other points than autograd (residual adds and the LoRA
    term inside the GEMMs, ga from the input-gradient GEMM), so element-wise they differ by
    bf16 noise; measured against the fp32 model both are equally close (relative norm error of
    the LoRA grads ~1.0-1.6% at these tiny shapes, within 10% of each other)."""
    def bf16_model():
        m = model_for(CONFIGS[family], seed=seed).to(torch.bfloat16)
        for n, p in m.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()
        return m

    batch = packed_batch()
    true_loss, true_grads = loss_and_grads(model_for(CONFIGS[family], seed=seed), batch)
    ref_loss, ref_grads = loss_and_grads(bf16_model(), batch)
    model = bf16_model()
    attach(model, [LayerPlan(0), LayerPlan(1), LayerPlan(2)])
    loss, grads = loss_and_grads(model, batch)

    def err(g):
        return float((g.float() - true_grads).norm() / true_grads.norm())
    assert err(grads) <= 1.25 * err(ref_grads) + 1e-3, (err(grads), err(ref_grads))
    assert abs(float(loss) - float(true_loss)) <= 2 * abs(float(ref_loss) - float(true_loss)) + 5e-3


def _watch_puts(store):
    handles = []
    put = store.put
    store.put = lambda state, offload: handles.append(put(state, offload)) or handles[-1]
    return handles


def test_frozen_lower_layers_keep_nothing():
    """Layers that autograd never back-propagates (no trainable weight, input needs no grad) keep
    and offload nothing, and the layer above does not prefetch them (on CUDA that prefetch was
    never waited for: its GPU buffers were freed while the side stream still wrote them)."""
    model = model_for(CONFIGS["llama"])
    for layer in model.model.layers[:2]:
        for p in layer.parameters():
            p.requires_grad_(False)
    engine = Engine()
    handles = _watch_puts(engine.store)
    plans = [LayerPlan(1, offload=True)] * 3
    batch = packed_batch()
    engine.attach(model, plans)
    loss_and_grads(model, batch)
    assert len(handles) == 1  # only the top layer kept anything
    assert handles[0].prev is None  # nothing below it to prefetch
    assert handles[0].gpu is None and handles[0].host is None  # and released it


def test_handles_chain_to_the_layer_below_and_prefetch_it():
    """Each layer's backward prefetches the state of the layer below (the handle put before its
    own), and every handle is let go by the end of the step."""
    model = model_for(CONFIGS["llama"])
    engine = Engine()
    handles = _watch_puts(engine.store)
    prefetched = []
    prefetch = engine.store.prefetch
    engine.store.prefetch = lambda h: prefetched.append(h) or prefetch(h)
    engine.attach(model, [LayerPlan(1, offload=True)] * 3)
    loss_and_grads(model, packed_batch())
    # per layer, top first: its own get (a prefetch of itself, no-op once loaded), then the
    # prefetch of the layer below
    h0, h1, h2 = handles
    assert prefetched == [h2, h1, h1, h0, h0, None]
    assert all(h.gpu is None and h.host is None and h.prev is None for h in handles)
    assert engine.store._last is None


@pytest.mark.parametrize("offload", [False, True])
def test_backward_frees_kept_tensors_as_it_goes(offload, monkeypatch):
    """A layer's backward lets go of each kept tensor once it is done with it: by the attention
    backward the kept gate/up and h_mid are gone (the memory planner counts on the gate/up of a
    whole-kept layer being free before the layers below run), and the gradients are unchanged."""
    import weakref

    model = model_for(CONFIGS["llama"])
    engine = Engine()
    store = engine.store
    kept_refs = _watch_puts(store)
    alive_at_attention = []
    real = engine.attention.backward

    def watched(*args, **kw):
        h = kept_refs.pop()  # backward runs top layer first: the last handle put
        gpu = h.gpu
        alive_at_attention.append({k for k in ("gu", "h_mid") if getattr(gpu, k) is not None}
                                  | {k for k, r in refs.pop().items() if r() is not None})
        return real(*args, **kw)

    refs = []
    get = store.get

    def get_and_watch(h):
        state = get(h)
        refs.append({k: weakref.ref(getattr(state, k)) for k in ("gu", "h_mid")})
        return state
    store.get = get_and_watch
    engine.attention.backward = watched
    batch = packed_batch()
    ref_loss, ref_grads = loss_and_grads(model, batch)
    engine.attach(model, [LayerPlan(2, offload=offload)] * 3)
    loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-6)
    assert alive_at_attention == [set(), set(), set()]


def test_pinned_pool_reuses_best_fit_and_stays_bounded(monkeypatch):
    made = []
    monkeypatch.setattr(st, "_new_pinned", lambda n: made.append(n) or torch.empty(n, dtype=torch.uint8))
    store = st.ActivationStore()

    def take(*sizes):
        h = st.Handle(None)
        bufs = [store._pinned(torch.empty(n, dtype=torch.bfloat16), h) for n in sizes]
        assert [b.shape[0] for b in bufs] == list(sizes) and all(b.dtype == torch.bfloat16 for b in bufs)
        return h

    a, b = take(100, 30), take(100, 30)
    assert made == [200, 60, 200, 60]
    store.release(a)
    store.release(b)
    c = take(20, 90)  # smaller requests reuse the smallest buffers that hold them
    assert made == [200, 60, 200, 60] and sorted(x.numel() for x in c.raw) == [60, 200]
    store.release(c)
    d = take(150)  # larger than any pooled buffer: a new one; the pool never exceeds the peak
    assert made[-1] == 300
    store.release(d)
    assert store.pooled_bytes() + store._in_use <= store._peak_use


@pytest.mark.parametrize("family,align", [("llama", 64), ("qwen2", 64), ("qwen3", 64), ("llama", 1)])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_projections_match_separate_gemms(family, align, backend):
    _check_packed(family, align, backend, lora_in_gemm=True)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_projections_without_lora_columns(family):
    """pack_lora=False: one GEMM per group with K = in, the LoRA term added after it."""
    _check_packed(family, 64, "triton", lora_in_gemm=False)


def _check_packed(family, align, backend, lora_in_gemm):
    """Packed q/k/v, gate/up and down weights (one GEMM each, LoRA folded in through extra
    columns) give the same loss and gradients as separate GEMMs, hold the base weights without
    copying them, and are packed again when a weight is replaced."""
    model = model_for(CONFIGS[family])
    plans = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]
    batch = packed_batch()
    layer = model.model.layers[1]
    gate, up, q = layer.mlp.gate_proj, layer.mlp.up_proj, layer.self_attn.q_proj
    w_up = up.weight.detach().clone()
    packed = Engine(EngineOptions(pack_align=align, pack_lora=lora_in_gemm))
    with kernels.backend(backend):
        attach(model, plans, EngineOptions(pack_projections=False))
        ref_loss, ref_grads = loss_and_grads(model, batch)
        assert getattr(gate, "_lt_packed_layout", None) is None
        packed.attach(model, plans)
        loss, grads = loss_and_grads(model, batch)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-6)

    buf = packed.weights.packed([gate, up])  # [2 I, H + 2 r + pad]: gate, then up rows
    inter, H, r = gate.out_features, gate.in_features, gate.r
    assert up.weight.data_ptr() == buf[inter].data_ptr() and torch.equal(up.weight, w_up)
    if not lora_in_gemm:
        assert buf.shape == (2 * inter, H)
        return
    assert buf.shape == (2 * inter, H + 2 * r if align == 1 else 64)  # padded to pack_align
    assert not buf[:, H + 2 * r:].any()
    assert up.weight.data_ptr() == buf[inter].data_ptr() and torch.equal(up.weight, w_up)
    torch.testing.assert_close(buf[inter:, H + r:H + 2 * r], up.lora_B.weight * up.scaling)
    assert not buf[:inter, H + r:].any() and not buf[inter:, H:H + r].any()
    assert q.weight.data_ptr() == packed.weights.packed(
        [q, layer.self_attn.k_proj, layer.self_attn.v_proj]).data_ptr()

    up.weight = torch.nn.Parameter(w_up.clone(), requires_grad=False)  # e.g. reloaded
    with kernels.backend(backend):
        loss2, grads2 = loss_and_grads(model, batch)
    new = packed.weights.packed([gate, up])
    assert new.data_ptr() != buf.data_ptr() and up.weight.data_ptr() == new[inter].data_ptr()
    torch.testing.assert_close(grads2, ref_grads, rtol=1e-5, atol=1e-6)


def test_packing_follows_rank_changes_and_device_moves():
    """Re-attached adapters of another rank, or an adapter removed, re-pack the weights (no
    stale s * B columns); .to() leaves no reference to the old packed buffer."""
    model = model_for(CONFIGS["llama"])
    plans = [LayerPlan(1)] * 3
    check(model, plans)
    apply_lora(model, LoRAConfig(r=8, alpha=16), seed=1)  # same padded width as r=4
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    check(model, plans)
    for layer in model.model.layers:
        layer.self_attn.q_proj.lora_A = layer.self_attn.q_proj.lora_B = None
    check(model, plans)

    gate = model.model.layers[0].mlp.gate_proj
    assert gate.weight.untyped_storage().nbytes() > gate.weight.numel() * 4  # packed
    model.double()
    assert gate.weight.untyped_storage().nbytes() == gate.weight.numel() * 8  # its own copy
    assert not any(isinstance(v, torch.Tensor) for v in vars(gate).values())


def test_cudnn_backward_refusal_falls_back_to_autograd(monkeypatch):
    """If cuDNN runs the forward but refuses the backward, the gradients come from attention
    re-run under autograd (and cuDNN is switched off), not from an error mid-backward."""
    from leantune.model.attention import AttentionMeta, attention

    def refuse(*args, **kwargs):
        raise RuntimeError("cuDNN: no engine for this backward")

    backend = engine_attention.AttentionBackend(EngineOptions())
    monkeypatch.setattr(backend, "_cudnn_backward", refuse)
    B, T, Hq, Hk, D = 2, 5, 4, 2, 8
    q, k, v = (torch.randn(B, T, h, D) for h in (Hq, Hk, Hk))
    meta = AttentionMeta.build((B, T), torch.device("cpu"), None, None, T, {None})
    out = attention(q, k, v, meta, None, D ** -0.5)
    dout = torch.randn_like(out)
    state = engine_attention.CudnnState(None, (), False)
    grads = backend.backward(dout, q, k, v, out, state, meta, None, D ** -0.5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = torch.autograd.grad(attention(*leaves, meta, None, D ** -0.5), leaves, dout)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r)
    assert backend.use_cudnn is False


def test_keep_levels_are_named_and_plans_take_bare_levels():
    assert LayerPlan(2) == LayerPlan(Keep.ALL) and LayerPlan(0).keep is Keep.INPUT
    with pytest.raises(ValueError):
        LayerPlan(3)
