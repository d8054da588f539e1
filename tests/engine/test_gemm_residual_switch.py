"""EngineOptions.gemm_residual: a 16-bit projection's residual (down's, in the packed layers)
added by its cuBLAS GEMM (torch.addmm, which copies the residual into the output first) or, off
(the default), by one add pass after a plain GEMM. On and off give the same loss and LoRA
gradients (fp32, CPU, both kernel backends, packed, and unpacked with the LoRA-add kernel
off, every keep level); off, no
16-bit GEMM takes a residual; an FP8 base's GEMM adds it in its epilogue either way."""

import pytest
import torch

from helpers import CONFIGS, check, engine_loss_and_grads, model_for
from leantune.engine import EngineOptions, LayerPlan
from leantune.lora.base_weight import quantize_fp8_

PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]


def _spy_residuals(monkeypatch):
    """Records, per 16-bit base GEMM (DenseBase.mm), the residual's shape or None."""
    from leantune.lora import base_weight

    seen = []
    orig = base_weight.DenseBase.mm

    def mm(self, x, out=None, resid=None):
        seen.append(None if resid is None else tuple(resid.shape))
        return orig(self, x, out=out, resid=resid)
    monkeypatch.setattr(base_weight.DenseBase, "mm", mm)
    return seen


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_on_and_off_agree(family, packed, backend, monkeypatch):
    model = model_for(CONFIGS[family])
    # (unpacked, lora_add_ adds LoRA and residual together unless fuse_lora_add is off)
    opts = {} if packed else dict(pack_projections=False, fuse_lora_add=False)
    seen = _spy_residuals(monkeypatch)
    loss_off, g_off = engine_loss_and_grads(model, backend, PLANS, **opts)
    assert seen and not any(seen)
    seen.clear()
    loss_on, g_on = engine_loss_and_grads(model, backend, PLANS, gemm_residual=True, **opts)
    hidden = model.config.hidden_size
    assert any(s is not None and s[1] == hidden for s in seen)  # down's, o's
    tol = 1e-5 if backend == "reference" else 2e-5
    torch.testing.assert_close(loss_on, loss_off, rtol=tol, atol=tol)
    torch.testing.assert_close(g_on, g_off, rtol=tol, atol=tol)


@pytest.mark.parametrize("on", [True, False])
def test_fused_matches_autograd(on):
    check(model_for(CONFIGS["llama"]), PLANS, options=EngineOptions(gemm_residual=on))


def test_fp8_adds_it_in_the_gemm_either_way(monkeypatch):
    """An FP8 source adds the residual in its GEMM whatever the switch (no add pass)."""
    from leantune.engine.projections import ProjectionGroup
    from leantune.engine.weights import DenseWeights

    m = quantize_fp8_(model_for(CONFIGS["llama"]))
    down = m.layers[0].mlp.down_proj
    for on in (True, False):
        group = ProjectionGroup([down], torch.float32,
                                DenseWeights(EngineOptions(gemm_residual=on)), pack=False)
        assert group.resid_in_gemm
    group = ProjectionGroup([model_for(CONFIGS["llama"]).layers[0].mlp.down_proj],
                            torch.float32, DenseWeights(EngineOptions()), pack=False)
    assert not group.resid_in_gemm


def _o_group_and_inputs(on: bool, rows: int, seed: int):
    """An unpacked o projection's group (gemm_residual `on`, LoRA added after the GEMM by
    addmm_), its input x, a residual r and want = r + o(x)."""
    from leantune.engine.projections import ProjectionGroup
    from leantune.engine.weights import DenseWeights

    o_proj = model_for(CONFIGS["llama"]).layers[0].self_attn.o_proj
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, o_proj.in_features, generator=g)
    r = torch.randn(rows, o_proj.out_features, generator=g)
    group = ProjectionGroup([o_proj], torch.float32,
                            DenseWeights(EngineOptions(gemm_residual=on, fuse_lora_add=False)),
                            pack=False)
    with torch.no_grad():
        want = r + o_proj(x)
    return group, x, r, want


def test_out_given_and_resid_elsewhere():
    """project(resid=r, out=o) with o another buffer: r + y in o, r untouched, both ways."""
    from leantune import kernels

    with torch.no_grad(), kernels.backend("reference"):
        for on in (True, False):
            group, x, r, want = _o_group_and_inputs(on, 5, 0)
            r0, out = r.clone(), torch.full_like(r, float("nan"))
            got = group.project(x, resid=r0, out=out)
            assert got.data_ptr() == out.data_ptr()
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(r0, r)


def test_env_switch(monkeypatch):
    monkeypatch.setenv("LEANTUNE_GEMM_RESIDUAL", "1")
    opts, names = EngineOptions().with_env_overrides()
    assert opts.gemm_residual and "gemm_residual" in names


def test_a_residual_needs_a_group_of_one():
    """A residual for a group of several projections is refused whatever the switches (it
    would be dropped: no GEMM of one output takes it)."""
    import pytest as _pytest

    from leantune.engine.projections import ProjectionGroup
    from leantune.engine.weights import DenseWeights

    mlp = model_for(CONFIGS["llama"]).layers[0].mlp
    x = torch.randn(3, mlp.gate_proj.in_features)
    r = torch.randn(3, 2 * mlp.gate_proj.out_features)
    for on in (True, False):
        group = ProjectionGroup([mlp.gate_proj, mlp.up_proj], torch.float32,
                                DenseWeights(EngineOptions(gemm_residual=on,
                                                           pack_projections=False,
                                                           fuse_lora_add=False)), pack=False)
        with torch.no_grad(), _pytest.raises(ValueError, match="group of one projection"):
            group.project(x, resid=r)


@pytest.mark.parametrize("on", [True, False])
def test_in_place_out_is_the_residual(on):
    """out is resid (the GEMM writing over the residual): r + y either way."""
    from leantune import kernels

    group, x, r, want = _o_group_and_inputs(on, 4, 1)
    with torch.no_grad(), kernels.backend("reference"):
        buf = r.clone()
        got = group.project(x, resid=buf, out=buf)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
