"""EngineOptions.fuse_glu_lora: where gate/up's LoRA is not inside their GEMM (an FP8 base;
unpacked projections), the GLU kernels add its low-rank terms. On and off give the same loss
and LoRA gradients (fp32, CPU, both kernel backends, every keep level, SwiGLU and GeGLU, Gemma's
MLP-out norm), the fused layers still equal plain autograd, and on, the GLU kernels get the
terms while no pass adds them to gate | up; packed 16-bit layers (LoRA inside the GEMM) are
unchanged."""

import pytest
import torch

from helpers import CONFIGS, GEMMA2_NO_SOFTCAP, check, engine_loss_and_grads, model_for
from leantune import kernels
from leantune.engine import EngineOptions, LayerPlan
from leantune.engine import executor as executor_module
from leantune.lora.base_weight import quantize_fp8_

PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]
FAMILIES = {"llama": CONFIGS["llama"], "gelu": CONFIGS["gelu"], "qwen3": CONFIGS["qwen3"],
            "gemma2": GEMMA2_NO_SOFTCAP}


def _model(family, base):
    m = model_for(FAMILIES[family])
    return quantize_fp8_(m) if base == "fp8" else m


def _run(model, backend, plans=PLANS, **options):
    return engine_loss_and_grads(model, backend, plans, **options)


def _spy_glu(monkeypatch, dy=None):
    """Records, per glu_fwd / glu_bwd_ call, whether it got gate/up's low-rank terms (and in
    `dy`, per glu_bwd_ call, whether it got the down projection's dx term)."""
    seen = []
    for name in ("glu_fwd", "glu_bwd_"):
        orig = getattr(executor_module, name)

        def spy(*a, _orig=orig, _name=name, lora=None, **k):
            seen.append(lora is not None)
            if _name == "glu_bwd_" and dy is not None:
                dy.append(k.get("dy_lora") is not None)
            return _orig(*a, lora=lora, **k)
        monkeypatch.setattr(executor_module, name, spy)
    return seen


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("base", ["fp8", "unpacked"])
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_on_and_off_agree(family, base, backend, monkeypatch):
    model = _model(family, base)
    unpacked = dict(pack_projections=False) if base == "unpacked" else {}
    dy = []
    seen = _spy_glu(monkeypatch, dy)
    loss_on, g_on = _run(model, backend, **unpacked)
    assert seen and all(seen) and dy and all(dy)  # every GLU call took the terms
    seen.clear(), dy.clear()
    loss_off, g_off = _run(model, backend, fuse_glu_lora=False, **unpacked)
    assert seen and not any(seen) and dy and not any(dy)
    tol = 1e-5 if backend == "reference" else 2e-5
    torch.testing.assert_close(loss_on, loss_off, rtol=tol, atol=tol)
    torch.testing.assert_close(g_on, g_off, rtol=tol, atol=tol)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_fused_with_terms_matches_autograd(family):
    model = _model(family, "fp8")
    with kernels.backend("reference"):
        check(model, PLANS, rtol=1e-4, atol=2e-4)
    check(_model(family, "unpacked"), PLANS, options=EngineOptions(pack_projections=False))


def test_no_addition_pass_over_gate_up(monkeypatch):
    """On, no rank-r product is added to gate | up after their GEMM (addmm_ with a gate or up
    projection's B); the other groups still add theirs."""
    model = _model("llama", "fp8")
    gate_up_b = {m.lora_B.weight.data_ptr() for layer in model.layers
                 for m in (layer.mlp.gate_proj, layer.mlp.up_proj)}
    mats = []
    orig = torch.Tensor.addmm_

    def addmm_(self, mat1, mat2, **k):
        mats.append(mat2.data_ptr())
        return orig(self, mat1, mat2, **k)
    monkeypatch.setattr(torch.Tensor, "addmm_", addmm_)
    _run(model, "reference")
    assert mats and not gate_up_b & set(mats)
    mats.clear()
    # (fuse_lora_add off too: on, it adds gate | up's terms in one lora_add_ pass instead)
    _run(model, "reference", fuse_glu_lora=False, fuse_lora_add=False)
    assert gate_up_b & set(mats)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_packed_16bit_layers_keep_gate_up_lora_in_the_gemm(backend, monkeypatch):
    """Packed with LoRA columns, gate/up's terms stay inside their GEMM; the down projection's
    dx term (dx += ga A, a pass of its own there too) goes into the GLU backward, on and off
    agreeing."""
    dy = []
    seen = _spy_glu(monkeypatch, dy)
    model = _model("llama", "bf16-packed")
    loss_on, g_on = _run(model, backend)
    assert seen and not any(seen) and dy and all(dy)
    loss_off, g_off = _run(model, backend, fuse_glu_lora=False)
    torch.testing.assert_close(loss_on, loss_off, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(g_on, g_off, rtol=2e-5, atol=2e-5)


def test_ranks_past_the_kernels_limit_take_the_passes(monkeypatch):
    """gate + up's ranks over MAX_LORA_RANK (here r = 40 each: 80 columns) stay on the addmm_
    passes, the down projection's too; the loss and gradients still equal autograd's."""
    from leantune import LoRAConfig, apply_lora
    from leantune.kernels.swiglu import MAX_LORA_RANK
    from leantune.model.config import ModelConfig
    from leantune.model.loader import build_empty

    torch.manual_seed(0)
    m = build_empty(ModelConfig.from_dict(FAMILIES["llama"]), torch.float32, torch.device("cpu"))
    m.init_weights(std=0.1, seed=0)
    apply_lora(m, LoRAConfig(r=40, alpha=8, targets="gate,up,down"), seed=0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    assert 2 * 40 > MAX_LORA_RANK
    m = quantize_fp8_(m)
    dy = []
    seen = _spy_glu(monkeypatch, dy)
    with kernels.backend("reference"):
        check(m, PLANS, rtol=1e-4, atol=2e-4)
    assert seen and not any(seen) and dy and all(dy)  # (down's r = 40 <= the limit)
