"""glu_fwd / glu_bwd_ with the gate/up projections' low-rank (LoRA) terms computed in the kernel
(`lora`: gate + xa Bg^T, up + xa Bu^T): the Triton kernels (interpreter) and the reference equal
autograd over the explicit formula, forward and backward, on odd shapes (rows and columns not
multiples of the tiles, R not a power of two), row-strided gate/up halves of one GEMM output,
h_out aliasing dy, and the codes of the fused FP8 quantisation equal quantize_rows of the
output."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels.fp8_quant import QuantizedRows, quantize_rows_reference
from leantune.kernels.swiglu import ACTS, glu_bwd_, glu_fwd

TOL = {torch.float32: (1e-5, 5e-5), torch.bfloat16: (2e-2, 2e-2)}


def _inputs(rows, inter, R, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    gu = (torch.randn(rows, 2 * inter, generator=g) * 2).to(dtype)  # gate | up
    xa = torch.randn(rows, R, generator=g).to(dtype)
    bg = (torch.randn(inter, R, generator=g) * 0.3).to(dtype)
    bu = (torch.randn(inter, R, generator=g) * 0.3).to(dtype)
    bu[:, : R // 2] = 0  # (block matrices: each projection's own columns)
    bg[:, R // 2:] = 0
    dy = torch.randn(rows, inter, generator=g).to(dtype)
    return gu, (xa, bg, bu), dy


def _expected(gu, lora, dy, act, inter):
    """Autograd through act(g + xa bg^T) * (u + xa bu^T), fp32: h, d gate, d up."""
    xa, bg, bu = (t.float() for t in lora)
    g = gu[:, :inter].float().requires_grad_()
    u = gu[:, inter:].float().requires_grad_()
    ge, ue = g + xa @ bg.t(), u + xa @ bu.t()
    name = {v: k for k, v in ACTS.items()}[act]
    a = (torch.nn.functional.silu(ge) if name == "silu" else
         torch.nn.functional.gelu(ge, approximate="tanh" if name == "gelu_tanh" else "none"))
    h = a * ue
    dg, du = torch.autograd.grad(h, (g, u), dy.float())
    return h.detach(), dg, du


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("act", sorted(ACTS))
@pytest.mark.parametrize("rows,inter,R", [(37, 200, 20), (1, 3, 2), (33, 129, 48)])
def test_glu_with_lora_matches_autograd(backend, dtype, act, rows, inter, R):
    gu0, lora, dy0 = _inputs(rows, inter, R, dtype)
    h_ref, dg_ref, du_ref = _expected(gu0, lora, dy0, ACTS[act], inter)
    rtol, atol = TOL[dtype]
    with kernels.backend(backend):
        wide = torch.full((rows, inter + 3), 7.0, dtype=dtype)
        h = glu_fwd(gu0[:, :inter], gu0[:, inter:], ACTS[act], out=wide[:, :inter], lora=lora)
        assert (wide[:, inter:] == 7).all()  # columns beside the output untouched
        torch.testing.assert_close(h.float(), h_ref, rtol=rtol, atol=atol)
        gu, dy = gu0.clone(), dy0.clone()
        glu_bwd_(dy, gu[:, :inter], gu[:, inter:], ACTS[act], h_out=dy, lora=lora)
        torch.testing.assert_close(gu[:, :inter].float(), dg_ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(gu[:, inter:].float(), du_ref, rtol=rtol, atol=atol)
        torch.testing.assert_close(dy.float(), h_ref, rtol=rtol, atol=atol)  # h_out over dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_and_reference_agree_closely(dtype):
    gu0, lora, dy0 = _inputs(45, 300, 32, dtype, seed=3)
    outs = {}
    for backend in ("triton", "reference"):
        with kernels.backend(backend):
            h = glu_fwd(gu0[:, :300], gu0[:, 300:], ACTS["silu"], lora=lora)
            gu, dy = gu0.clone(), dy0.clone()
            glu_bwd_(dy, gu[:, :300], gu[:, 300:], ACTS["silu"], lora=lora)
            outs[backend] = (h.float(), gu.float())
    tol = (1e-5, 1e-5) if dtype == torch.float32 else (1e-2, 1e-2)
    for a, b in zip(outs["triton"], outs["reference"]):
        torch.testing.assert_close(a, b, rtol=tol[0], atol=tol[1])


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("inter", [128, 384])
def test_fused_quantisation_with_lora_writes_quantize_rows_codes(backend, inter):
    gu, lora, _ = _inputs(21, inter, 16, torch.bfloat16, seed=5)
    with kernels.backend(backend):
        out = torch.empty(21, inter, dtype=torch.bfloat16)
        q = QuantizedRows.empty(out)
        h = glu_fwd(gu[:, :inter], gu[:, inter:], ACTS["silu"], out=out, quant=q.targets,
                    lora=lora)
    codes, scale_t = quantize_rows_reference(h)
    assert torch.equal(q.targets[0].view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(q.targets[1], scale_t)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_gu_terms", [True, False])
def test_glu_bwd_adds_the_down_projections_dx_term(backend, dtype, with_gu_terms):
    """dy_lora = (ga, a): the backward reads dy + ga a (the down projection's input gradient
    with its LoRA term), with or without gate/up's own terms; ga a column view of a wider
    buffer, as the packed input-gradient GEMM leaves it."""
    rows, inter, R, RD = 29, 150, 20, 12
    gu0, lora, dy0 = _inputs(rows, inter, R, dtype, seed=7)
    g = torch.Generator().manual_seed(8)
    wide = torch.randn(rows, inter + RD + 5, generator=g).to(dtype)
    ga = wide[:, inter:inter + RD]
    a = (torch.randn(RD, inter, generator=g) * 0.2).to(dtype)
    dy_full = (dy0.float() + ga.float() @ a.float()).to(torch.float32)
    terms = lora if with_gu_terms else (torch.zeros(rows, 1, dtype=dtype),
                                        torch.zeros(inter, 1, dtype=dtype),
                                        torch.zeros(inter, 1, dtype=dtype))
    h_ref, dg_ref, du_ref = _expected(gu0, terms, dy_full, ACTS["silu"], inter)
    rtol, atol = TOL[dtype]
    with kernels.backend(backend):
        gu, dy = gu0.clone(), dy0.clone()
        glu_bwd_(dy, gu[:, :inter], gu[:, inter:], ACTS["silu"], h_out=dy,
                 lora=lora if with_gu_terms else None, dy_lora=(ga, a))
    torch.testing.assert_close(gu[:, :inter].float(), dg_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(gu[:, inter:].float(), du_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(dy.float(), h_ref, rtol=rtol, atol=atol)


@pytest.mark.parametrize("tile", [(16, 256, 4), (64, 128, 8)])
def test_other_tiles_give_the_same_results(tile, monkeypatch):
    """The tiles the bench sweeps (BLOCK_N of two quantisation blocks, more rows) compute the
    same values and codes as the default's."""
    import importlib

    swiglu = importlib.import_module("leantune.kernels.swiglu")  # (the package's swiglu: a fn)
    gu0, lora, dy0 = _inputs(37, 300, 20, torch.float32, seed=9)
    res = {}
    for name, tiles in (("default", dict(swiglu.LORA_TILES)),
                        ("other", {"fwd": tile, "bwd": tile})):
        monkeypatch.setattr(swiglu, "LORA_TILES", tiles)
        with kernels.backend("triton"):
            out = torch.empty(37, 300)
            q = QuantizedRows.empty(out)
            h = glu_fwd(gu0[:, :300], gu0[:, 300:], ACTS["silu"], out=out, quant=q.targets,
                        lora=lora)
            gu, dy = gu0.clone(), dy0.clone()
            glu_bwd_(dy, gu[:, :300], gu[:, 300:], ACTS["silu"], h_out=dy, lora=lora)
        res[name] = (h.clone(), q.targets[0].view(torch.uint8).clone(), q.targets[1].clone(),
                     gu, dy)
    for a, b in zip(res["default"], res["other"]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_bad_lora_shapes_are_one_clear_error():
    gu, (xa, bg, bu), _ = _inputs(5, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="lora: expected xa"):
        glu_fwd(gu[:, :8], gu[:, 8:], 0, lora=(xa, bg[:4], bu))
    with pytest.raises(ValueError, match="lora: expected xa"):
        glu_bwd_(gu[:, 8:].clone(), gu[:, :8], gu[:, 8:], 0, lora=(xa.t(), bg, bu))
    with pytest.raises(ValueError, match="dy_lora: expected ga"):
        glu_bwd_(gu[:, 8:].clone(), gu[:, :8], gu[:, 8:], 0, dy_lora=(xa, bg))


def test_mixed_dtypes_and_too_many_columns_are_one_clear_error():
    from leantune.kernels.swiglu import MAX_LORA_RANK

    gu, (xa, bg, bu), _ = _inputs(5, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="of gate's dtype"):
        glu_fwd(gu[:, :8], gu[:, 8:], 0, lora=(xa.bfloat16(), bg.bfloat16(), bu.bfloat16()))
    with pytest.raises(ValueError, match="of gate's dtype"):
        glu_bwd_(gu[:, 8:].clone(), gu[:, :8], gu[:, 8:], 0,
                 dy_lora=(xa.double(), torch.zeros(4, 8, dtype=torch.float64)))
    R = MAX_LORA_RANK + 1
    with pytest.raises(ValueError, match=f"R <= {MAX_LORA_RANK}"):
        glu_fwd(gu[:, :8], gu[:, 8:], 0,
                lora=(torch.zeros(5, R), torch.zeros(8, R), torch.zeros(8, R)))
