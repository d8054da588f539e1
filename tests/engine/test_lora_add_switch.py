"""EngineOptions.fuse_lora_add: where a projection's LoRA term is not inside its GEMM (an FP8
base: q/k/v, o, down; the unpacked o projection of 16-bit layers; every projection unpacked),
one kernel (kernels/lora_add.py) adds it, with the residual, to the GEMM's output. On and off
give the same loss and LoRA gradients (fp32, CPU, both kernel backends, every keep level; Gemma
2's attention-out norm: o without a residual; q/k/v biases; a MoE layer's attention), the fused
layers still equal plain autograd, and on, no addmm_ adds a LoRA term after a GEMM while off
they do."""

import pytest
import torch

from helpers import CONFIGS, GEMMA2_NO_SOFTCAP, check, engine_loss_and_grads, model_for
from leantune import kernels
from leantune.engine import EngineOptions, LayerPlan
from leantune.engine import projections as projections_module
from leantune.lora.base_weight import quantize_fp8_

PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]
FAMILIES = {"llama": CONFIGS["llama"], "qwen2": CONFIGS["qwen2"], "qwen3": CONFIGS["qwen3"],
            "gemma2": GEMMA2_NO_SOFTCAP}


def _model(family, base):
    m = model_for(FAMILIES[family])
    return quantize_fp8_(m) if base == "fp8" else m


def _run(model, backend, plans=PLANS, **options):
    return engine_loss_and_grads(model, backend, plans, **options)


def _spy(monkeypatch):
    """Counts lora_add_ calls, and records the B of every addmm_ (a LoRA term added after a
    GEMM)."""
    calls, mats = [], []
    orig_add = projections_module.lora_add_

    def lora_add_(*a, **k):
        calls.append(a[0].shape)
        return orig_add(*a, **k)
    monkeypatch.setattr(projections_module, "lora_add_", lora_add_)
    orig = torch.Tensor.addmm_

    def addmm_(self, mat1, mat2, **k):
        mats.append(mat2.data_ptr())
        return orig(self, mat1, mat2, **k)
    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    return calls, mats


def _lora_b(model, names):
    return {getattr(m, n).lora_B.weight.data_ptr() for layer in model.layers
            for m in (layer.self_attn, layer.mlp) for n in names if hasattr(m, n)}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("base", ["fp8", "unpacked", "packed"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_on_and_off_agree(family, base, backend, monkeypatch):
    model = _model(family, base)
    opts = dict(pack_projections=False) if base == "unpacked" else {}
    calls, mats = _spy(monkeypatch)
    loss_on, g_on = _run(model, backend, **opts)
    assert calls  # (packed 16-bit layers: the o projection alone)
    bs = _lora_b(model, ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"])
    assert not bs & {m for m in mats}  # no LoRA term added by addmm_ after a GEMM
    calls.clear(), mats.clear()
    loss_off, g_off = _run(model, backend, fuse_lora_add=False, **opts)
    assert not calls and bs & set(mats)
    tol = 1e-5 if backend == "reference" else 2e-5
    torch.testing.assert_close(loss_on, loss_off, rtol=tol, atol=tol)
    torch.testing.assert_close(g_on, g_off, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma2"])
def test_fused_with_the_kernel_matches_autograd(family):
    with kernels.backend("reference"):
        check(_model(family, "fp8"), PLANS, rtol=1e-4, atol=2e-4)
    check(_model(family, "unpacked"), PLANS, options=EngineOptions(pack_projections=False))
    check(_model(family, "packed"), PLANS)


def test_which_groups_take_the_kernel(monkeypatch):
    """Packed 16-bit layers: q/k/v and down keep their LoRA inside the GEMM, o (unpacked) takes
    the kernel with its residual; an FP8 base: q/k/v (one call for the three), o and down."""
    calls, _ = _spy(monkeypatch)
    model = _model("llama", "packed")
    cfg = model.config
    _run(model, "reference", plans=[LayerPlan(0)] * cfg.num_hidden_layers)
    assert {tuple(s)[1] for s in calls} == {cfg.hidden_size}  # o's output only
    calls.clear()
    model = _model("llama", "fp8")
    _run(model, "reference", plans=[LayerPlan(0)] * cfg.num_hidden_layers)
    widths = {tuple(s)[1] for s in calls}
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    assert widths == {q + 2 * kv, cfg.hidden_size}  # q | k | v in one call; o and down


def test_moe_attention_on_and_off_agree(monkeypatch):
    from helpers import tiny_config

    m = quantize_fp8_(model_for(tiny_config("mixtral").to_dict(), targets="q,k,v,o"))
    calls, _ = _spy(monkeypatch)
    plans = [LayerPlan(0)] * len(m.layers)
    loss_on, g_on = _run(m, "reference", plans=plans)
    assert calls
    loss_off, g_off = _run(m, "reference", plans=plans, fuse_lora_add=False)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_on, g_off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", ["fp8", "unpacked"])
def test_groups_with_projections_without_lora(base, monkeypatch):
    """LoRA on q and v alone: k's rows of B_cat are zeros, o and down have none (their GEMM
    adds the residual); on and off agree."""
    m = model_for(FAMILIES["llama"], targets="q,v")
    m = quantize_fp8_(m) if base == "fp8" else m
    opts = dict(pack_projections=False) if base == "unpacked" else {}
    calls, _ = _spy(monkeypatch)
    loss_on, g_on = _run(m, "reference", **opts)
    assert calls
    loss_off, g_off = _run(m, "reference", fuse_lora_add=False, **opts)
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_on, g_off, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("base", ["fp8", "packed"])
def test_out_may_be_the_residual(base):
    """project(resid=r, out=r) (the GEMM writing over the residual) adds r, as with the switch
    off, and as the layer's own forward (16-bit: r + o(x))."""
    from leantune.engine.projections import ProjectionGroup
    from leantune.engine.weights import DenseWeights

    o = _model("llama", base).layers[0].self_attn.o_proj
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, o.in_features, generator=g)
    r = torch.randn(5, o.out_features, generator=g)
    got = []
    with torch.no_grad(), kernels.backend("reference"):
        for fuse in (True, False):
            group = ProjectionGroup([o], torch.float32,
                                    DenseWeights(EngineOptions(fuse_lora_add=fuse)), pack=False)
            buf = r.clone()
            got.append(group.project(x, resid=buf, out=buf).clone())
        want = r + o(x)
    torch.testing.assert_close(got[0], got[1], rtol=1e-6, atol=1e-6)
    if base == "packed":
        torch.testing.assert_close(got[0], want, rtol=1e-5, atol=1e-5)


def test_env_switch(monkeypatch):
    for raw, want in (("0", False), ("on", True)):
        monkeypatch.setenv("LEANTUNE_FUSE_LORA_ADD", raw)
        opts, names = EngineOptions().with_env_overrides()
        assert opts.fuse_lora_add is want and "fuse_lora_add" in names
