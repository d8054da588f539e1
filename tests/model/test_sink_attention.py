"""Attention sinks over the kernel's log-sum-exp (model/sink_attention.py) against the mask path's
sink attention (`_scores_attention` with sinks: the softmax with the sink as an extra column,
under autograd):
outputs and the gradients of q, k, v and the sinks, on packed documents of odd lengths, GQA, with
and without a window, sinks far in both directions; through `attention(...)` on the varlen and
causal paths, and the tiny gpt-oss model forced onto the varlen path. On a CUDA GPU: the bf16
flash path against the fp32 reference."""

from __future__ import annotations

import pytest
import torch
from helpers import max_abs, one_torch_thread, random_ids, save_checkpoint  # noqa: F401

import leantune
from leantune.batch import PackedBatch, shift_labels
from leantune.model.attention import AttentionMeta, _scores_attention, attention
from leantune.model.sink_attention import (
    add_sinks,
    math_backward,
    math_forward,
    sink_attention_varlen,
    sinks_grad,
)

B, T, HQ, HK, D = 2, 13, 6, 2, 16
SEQ_LENS = [5, 1, 7, 3, 9, 1]  # three documents a row, odd lengths
SCALE = D ** -0.5
SINKS = {"moderate": [0.3, -0.7, 1.1, 0.0, -1.5, 2.0],
         "far": [-30.0, 30.0, 12.0, -12.0, 0.5, -0.5]}  # a sink taking (nearly) all or nothing
TOL = 1e-5


def _inputs(seed=0, dtype=torch.float32, device="cpu", sinks="moderate"):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, T, h, D, generator=g) for h in (HQ, HK, HK))
    s = torch.tensor(SINKS[sinks])
    dout = torch.randn(B, T, HQ, D, generator=g)
    q, k, v, s = (t.to(device, dtype).requires_grad_() for t in (q, k, v, s))
    return q, k, v, s, dout.to(device, dtype)


def _meta(path, device="cpu", seq_lens=SEQ_LENS):
    return AttentionMeta.build((B, T), torch.device(device), seq_lens=seq_lens, cu_seqlens=None,
                               max_seqlen=max(seq_lens), windows={None, 3}, dtype=torch.float32,
                               path=path)


def _out_and_grads(fn, q, k, v, s, dout):
    out = fn(q, k, v, s)
    return [out, *torch.autograd.grad(out, (q, k, v, s), dout)]


def _reference(q, k, v, s, dout, window, seq_lens=SEQ_LENS):
    mask = _meta("mask", q.device.type, seq_lens).masks[window]
    return _out_and_grads(lambda *t: _scores_attention(*t[:3], mask, SCALE, t[3]), q, k, v, s,
                          dout)


@pytest.mark.parametrize("sinks", sorted(SINKS))
@pytest.mark.parametrize("window", [None, 3])
def test_varlen_sink_attention_equals_the_mask_path(window, sinks):
    q, k, v, s, dout = _inputs(sinks=sinks)
    meta = _meta("varlen")
    assert meta.cu_seqlens.tolist() == [0, 5, 6, 13, 16, 25, 26]
    got = _out_and_grads(lambda *t: sink_attention_varlen(
        *t, meta.cu_seqlens, meta.max_seqlen, window, SCALE), q, k, v, s, dout)
    ref = _reference(q, k, v, s, dout, window)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert max_abs(a, b) < TOL * max(1.0, b.abs().max().item()), name
    assert ref[4].abs().max() > 1e-3  # the sinks' gradient is not trivially zero


@pytest.mark.parametrize("window", [None, 3])
def test_attention_takes_the_sink_path_on_varlen_metadata(window):
    q, k, v, s, dout = _inputs(seed=1)
    meta = _meta("varlen")
    got = _out_and_grads(lambda *t: attention(*t[:3], meta, window, SCALE, t[3]), q, k, v, s,
                         dout)
    ref = _reference(q, k, v, s, dout, window)
    for a, b in zip(got, ref):
        assert max_abs(a, b) < TOL


def test_causal_path_with_sinks_is_one_document_a_row():
    q, k, v, s, dout = _inputs(seed=2)
    meta = AttentionMeta.build((B, T), torch.device("cpu"), seq_lens=None, cu_seqlens=None,
                               max_seqlen=T, windows={None}, dtype=torch.float32)
    assert meta.path == "causal"
    got = _out_and_grads(lambda *t: attention(*t[:3], meta, None, SCALE, t[3]), q, k, v, s, dout)
    ref = _reference(q, k, v, s, dout, None, seq_lens=[T] * B)
    for a, b in zip(got, ref):
        assert max_abs(a, b) < TOL


def test_sink_algebra_on_plain_attention():
    """add_sinks turns plain attention's (out, lse) into the sink softmax's; a sink far below
    every score changes nothing; math_backward given out', lse' is the sink attention's
    backward, and sinks_grad matches autograd's (all at the function level, no autograd.Function)."""
    q, k, v, s, dout = _inputs(seed=3)
    meta = _meta("varlen")
    cu = meta.cu_seqlens
    with torch.no_grad():
        out, lse = math_forward(q, k, v, cu, 3, SCALE)
        plain = attention(q, k, v, _meta("mask"), 3, SCALE)
        assert max_abs(out, plain) < TOL
        off, _ = add_sinks(out, lse, torch.full((HQ,), -1e4))
        assert torch.equal(off, out)
        out_s, lse_s = add_sinks(out, lse, s)
        assert lse_s.shape == (HQ, B * T) and lse_s.dtype == torch.float32
        grads = [*math_backward(dout, q, k, v, out_s, lse_s, cu, 3, SCALE),
                 sinks_grad(dout, out_s, lse_s, s)]
    ref = _reference(q, k, v, s, dout, 3)
    for a, b in zip([out_s, *grads], ref):
        assert max_abs(a, b) < TOL


def test_sinks_gradient_comes_back_in_their_dtype():
    q, k, v, s, dout = _inputs(seed=4)
    s16 = s.detach().to(torch.bfloat16).requires_grad_()
    meta = _meta("varlen")
    out = sink_attention_varlen(q, k, v, s16, meta.cu_seqlens, meta.max_seqlen, None, SCALE)
    (ds,) = torch.autograd.grad(out, s16, dout)
    assert out.dtype == torch.float32 and ds.dtype == torch.bfloat16
    ref = _reference(q, k, v, s16.float(), dout, None)[4]
    assert max_abs(ds, ref) < 1e-2 * ref.abs().max().item()


def test_gpt_oss_on_the_varlen_path_equals_the_mask_path(tmp_path):
    """The tiny gpt-oss model (sinks, alternating sliding windows) forced onto the varlen path on
    the CPU: its loss and every parameter's gradient (the sinks' included) are the mask path's."""
    save_checkpoint("gpt_oss", tmp_path, seed=7)
    model = leantune.load_model(tmp_path, device="cpu")
    g = torch.Generator().manual_seed(5)
    lens = [[5, 9], [11, 3]]
    rows = [[(ids, shift_labels(ids, [True] * n)) for n in row
             for ids in [random_ids(n, model.config.vocab_size, g)]] for row in lens]
    batch = PackedBatch.from_documents(rows, pad_to_multiple=8)
    results = {}
    for path in ("mask", "varlen"):
        model.attention_path = path
        model.zero_grad()
        loss = model(batch=batch, loss_only=True).loss_sum
        loss.backward()
        results[path] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                         if p.grad is not None})
    (loss_m, grads_m), (loss_v, grads_v) = results["mask"], results["varlen"]
    assert abs(loss_m.item() - loss_v.item()) < 1e-5 * abs(loss_m.item())
    assert grads_m.keys() == grads_v.keys()
    assert any(n.endswith("sinks") for n in grads_m)
    for n in grads_m:
        assert max_abs(grads_m[n], grads_v[n]) < 1e-5 * max(1.0, grads_m[n].abs().max().item()), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (flash attention)")
@pytest.mark.parametrize("window", [None, 3])
def test_flash_sink_attention_matches_the_fp32_reference(window):
    q, k, v, s, dout = _inputs(seed=6, device="cuda")
    meta = _meta("varlen", "cuda")
    ref = _reference(q, k, v, s, dout, window)
    half = [t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    s32 = s.detach().clone().requires_grad_()  # an fp32 parameter, as gpt-oss may keep it
    got = _out_and_grads(lambda *t: sink_attention_varlen(
        *t, meta.cu_seqlens, meta.max_seqlen, window, SCALE), *half, s32, dout.bfloat16())
    assert got[0].dtype == torch.bfloat16 and got[4].dtype == torch.float32
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], got, ref):
        assert max_abs(a, b) < 3e-2 * max(1.0, b.abs().max().item()), name


def test_frozen_sinks_get_no_gradient_and_the_rest_is_unchanged(monkeypatch):
    """Frozen sinks (LoRA training): their gradient is not computed; q, k, v's are the same."""
    from leantune.model import sink_attention as sa
    from leantune.model.sink_attention import sink_attention_varlen

    calls = []
    real = sa.sinks_grad
    monkeypatch.setattr(sa, "sinks_grad", lambda *a: calls.append(1) or real(*a))

    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 9, 4, 8, generator=g, requires_grad=True)
    k = torch.randn(1, 9, 2, 8, generator=g, requires_grad=True)
    v = torch.randn(1, 9, 2, 8, generator=g, requires_grad=True)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    grads = []
    for trainable in (True, False):
        sinks = torch.randn(4, generator=torch.Generator().manual_seed(6)).requires_grad_(trainable)
        out = sink_attention_varlen(q, k, v, sinks, cu, 5, None, 0.3)
        grads.append(torch.autograd.grad(out.square().sum(), [q, k, v]))
        assert len(calls) == 1  # the trainable sinks' backward only
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
