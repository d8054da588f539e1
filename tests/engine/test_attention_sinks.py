"""The engine's attention backend with attention sinks (gpt-oss): forward's output and backward's
(dq, dk, dv, dsinks) equal the model's mask-path sink attention under autograd, on the backend's
CPU paths (recompute, kept graph; mask and varlen metadata) and on its flash path with the flash
ops stood in for by the math reference (the state keeps the sink-inclusive log-sum-exp); without
sinks backward still returns three gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import max_abs, one_torch_thread  # noqa: F401  (autouse)

import leantune.engine.attention as backend_mod
from leantune.engine.attention import AttentionBackend, FlashState, GraphState
from leantune.engine.options import EngineOptions
from leantune.model.attention import AttentionMeta, _scores_attention
from leantune.model.sink_attention import math_backward, math_forward

B, T, HQ, HK, D = 2, 11, 6, 2, 16
SEQ_LENS = [3, 7, 1, 5, 1, 5]  # three documents a row, odd lengths
SCALE = D ** -0.5
TOL = 1e-5


def _meta(path):
    return AttentionMeta.build((B, T), torch.device("cpu"), seq_lens=SEQ_LENS, cu_seqlens=None,
                               max_seqlen=max(SEQ_LENS), windows={None, 3}, dtype=torch.float32,
                               path=path)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (HQ, HK, HK))
    sinks = torch.nn.Parameter(torch.tensor([-20.0, 0.4, 20.0, -1.0, 1.5, 0.0]))
    return q, k, v, sinks, torch.randn(B, T, HQ, D, generator=g)


def _reference(q, k, v, sinks, dout, window):
    leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
    out = _scores_attention(*leaves[:3], _meta("mask").masks[window], SCALE, leaves[3])
    return [out.detach(), *torch.autograd.grad(out, leaves, dout)]


def _check(got, ref):
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert max_abs(a, b) < TOL * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("for_backward", [False, True])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("path", ["mask", "varlen"])
def test_backend_sinks_off_the_flash_path(path, window, for_backward):
    q, k, v, sinks, dout = _inputs()
    backend, meta = AttentionBackend(EngineOptions()), _meta(path)
    out, state = backend.forward(q, k, v, meta, window, SCALE, for_backward, sinks=sinks)
    assert isinstance(state, GraphState) if for_backward else state is None
    assert not out.requires_grad
    grads = backend.backward(dout, q, k, v, out, state, meta, window, SCALE, sinks=sinks)
    assert len(grads) == 4
    _check([out, *grads], _reference(q, k, v, sinks, dout, window))


def _fake_flash_forward(q, k, v, cu_seqlens, max_seqlen, window, scale):
    return *math_forward(q, k, v, cu_seqlens, window, scale), torch.empty(0)


def _fake_flash_backward(dout, q, k, v, out, lse, rng, cu_seqlens, max_seqlen, window, scale):
    return math_backward(dout, q, k, v, out, lse, cu_seqlens, window, scale)


@pytest.mark.parametrize("window", [None, 3])
def test_backend_sinks_on_the_flash_path(monkeypatch, window):
    """The flash path's sink plumbing, flash's ops replaced by the math reference they equal;
    cuDNN is never tried with sinks."""
    monkeypatch.setattr(backend_mod, "flash_ok", lambda q: True)
    monkeypatch.setattr(backend_mod, "flash_forward", _fake_flash_forward)
    monkeypatch.setattr(backend_mod, "flash_backward", _fake_flash_backward)
    backend, meta = AttentionBackend(EngineOptions()), _meta("varlen")
    monkeypatch.setattr(backend, "_cudnn_ok", lambda *a: True)
    monkeypatch.setattr(backend, "_cudnn_forward", lambda *a: pytest.fail("cuDNN with sinks"))
    q, k, v, sinks, dout = _inputs(seed=1)
    with torch.enable_grad():  # the parameter's graph stays out of the state
        out, state = backend.forward(q, k, v, meta, window, SCALE, sinks=sinks)
    assert isinstance(state, FlashState) and state.lse.shape == (HQ, B * T)
    assert not out.requires_grad and not state.lse.requires_grad
    plain_lse = math_forward(q, k, v, meta.cu_seqlens, window, SCALE)[1]
    assert torch.allclose(state.lse, torch.logaddexp(plain_lse, sinks.detach()[:, None]))
    grads = backend.backward(dout, q, k, v, out, state, meta, window, SCALE, sinks=sinks)
    _check([out, *grads], _reference(q, k, v, sinks, dout, window))
    assert len(backend.backward(dout, q, k, v, out, state, meta, window, SCALE)) == 3


def test_backend_without_sinks_returns_three_gradients():
    q, k, v, _, dout = _inputs(seed=2)
    backend, meta = AttentionBackend(EngineOptions()), _meta("mask")
    for for_backward in (False, True):
        out, state = backend.forward(q, k, v, meta, 3, SCALE, for_backward)
        grads = backend.backward(dout, q, k, v, out, state, meta, 3, SCALE)
        assert len(grads) == 3 and [g.shape for g in grads] == [q.shape, k.shape, v.shape]
