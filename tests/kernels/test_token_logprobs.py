"""Triton per-token log-probs (run by the Triton interpreter on CPU) against the reference (full
fp32 logits + log_softmax), forward and backward, and segment_sum over packed documents."""

from __future__ import annotations

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.kernels import cross_entropy as ce
# The same random problems and vocab steps of 128 (the autouse fixture) as the loss's tests.
from test_cross_entropy import IGNORE, _data, small_blocks  # noqa: F401

# Output (rtol, atol) per dtype: the logits are the same product on both paths and everything
# after it is fp32; only the order of the sums differs.
OUT_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-4, 1e-4)}
# Gradient (rtol, atol) per dtype. bf16: the kernel rounds dlogits to bf16 before the matrix
# products (the reference keeps them fp32 until autograd casts back): a few bf16 ulps.
GRAD_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 1e-2)}


def _outputs_and_grads(backend, hidden, weight, targets, upstream, **kw):
    """Run `token_logprobs` on `backend`; -> (outputs, grads of sum(upstream_k * output_k))."""
    inputs = [t for t in (hidden, weight) if t.requires_grad]
    with kernels.backend(backend):
        out = kernels.token_logprobs(hidden, weight, targets, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((u * o).sum() for u, o in zip(upstream, outs) if u is not None)
    return outs, torch.autograd.grad(loss, inputs)


def _check(hidden, weight, targets, entropy_grad=True, logp_grad=True, **kw):
    """Outputs and grads vs reference, for random per-token upstream gradients (one or both)."""
    N = hidden.shape[0]
    upstream = [torch.randn(N) if logp_grad else None]
    if kw.get("return_entropy"):
        upstream.append(torch.randn(N) if entropy_grad else None)
    outs, grads = _outputs_and_grads("triton", hidden, weight, targets, upstream, **kw)
    outs_ref, grads_ref = _outputs_and_grads("reference", hidden, weight, targets, upstream, **kw)
    rtol, atol = OUT_TOL[hidden.dtype]
    for a, b in zip(outs, outs_ref):
        assert a.dtype == torch.float32 and a.shape == (N,)
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    rtol, atol = GRAD_TOL[hidden.dtype]
    for a, b in zip(grads, grads_ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=rtol, atol=atol)
    return outs, grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("N,H,V,kw", [
    (9, 72, 333, {}),                                           # masked last vocab step
    (9, 72, 333, {"return_entropy": True}),                     # logp and entropy grads
    (9, 72, 333, {"softcap": 5.0, "return_entropy": True}),     # cap small enough to bite
    (7, 40, 257, {"temperature": 0.7, "return_entropy": True}),  # GRPO's sampling temperature
    (7, 40, 257, {"softcap": 4.0, "temperature": 1.6}),         # both: softcap then / T
    (1, 16, 333, {"softcap": 30.0, "return_entropy": True}),    # a single token
])
def test_matches_reference(dtype, N, H, V, kw):
    _check(*_data(N, H, V, dtype), **kw)


def test_logp_is_log_softmax_at_target():
    """Independent of the reference: exp(logp) of every target of one row sums to 1."""
    hidden, weight, _ = _data(1, 24, 333, torch.float32)
    targets = torch.arange(333)
    with torch.no_grad(), kernels.backend("triton"):
        logp, ent = kernels.token_logprobs(hidden.expand(333, -1), weight, targets,
                                           softcap=6.0, temperature=0.8, return_entropy=True)
    torch.testing.assert_close(logp.exp().sum(), torch.tensor(1.0), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, torch.full_like(ent, -(logp.exp() * logp).sum().item()),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_several_chunks(dtype, monkeypatch):
    """A chunk budget of 4 rows: several chunks, a short last one, the logits recomputed per
    chunk in backward, and (bf16) the fp32 accumulation of W's gradient across chunks."""
    V = 100
    row_bytes = V * torch.empty((), dtype=dtype).element_size()
    monkeypatch.setitem(ce.CHUNK_BYTES, "default", 4 * row_bytes)
    _check(*_data(10, 40, V, dtype), softcap=3.0, return_entropy=True)


@pytest.mark.parametrize("logp_grad,entropy_grad", [(True, False), (False, True)])
def test_one_output_used(logp_grad, entropy_grad):
    """Only one of the two outputs feeds the loss: the other's gradient arrives as None."""
    _check(*_data(8, 32, 150, torch.float32), return_entropy=True, logp_grad=logp_grad,
           entropy_grad=entropy_grad)


def test_ignored_rows_get_zero_and_no_gradient():
    hidden, weight, targets = _data(6, 16, 333, torch.float32, ignore_every=2)
    (logp, ent), (gh, _) = _check(hidden, weight, targets, return_entropy=True)
    ignored = targets == IGNORE
    assert not logp[ignored].any() and not ent[ignored].any()
    assert not gh[ignored].any() and gh[~ignored].abs().sum(-1).gt(0).all()
    assert (logp[~ignored] < 0).all() and (ent[~ignored] > 0).all()


def test_frozen_weight_gets_no_grad():
    """LoRA: W is frozen, so only hidden's gradient is formed."""
    hidden, weight, targets = _data(7, 72, 333, torch.float32)
    weight.requires_grad_(False)
    _check(hidden, weight, targets, return_entropy=True)
    with kernels.backend("triton"):
        kernels.token_logprobs(hidden, weight, targets).sum().backward()
    assert weight.grad is None and hidden.grad is not None


def test_weight_grad_only():
    hidden, weight, targets = _data(7, 72, 333, torch.float32)
    hidden.requires_grad_(False)
    _check(hidden, weight, targets, softcap=5.0)


def test_no_grad_mode_forward_only():
    hidden, weight, targets = _data(5, 16, 333, torch.float32)
    with torch.no_grad(), kernels.backend("triton"):
        logp, ent = kernels.token_logprobs(hidden, weight, targets, 5.0, 0.9, True)
    assert logp.grad_fn is None and ent.grad_fn is None
    ref = kernels.token_logprobs_reference(hidden, weight, targets, 5.0, 0.9, True)
    for a, b in zip((logp, ent), ref):
        torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise():
    hidden, weight, targets = _data(4, 16, 33, torch.float32)
    with pytest.raises(ValueError, match="targets has 3 entries"):
        kernels.token_logprobs(hidden, weight, targets[:3])
    with pytest.raises(ValueError, match="temperature"):
        kernels.token_logprobs(hidden, weight, targets, temperature=0.0)


def test_segment_sum_packed_documents():
    """Three documents and two padding tokens: sums per document, gradient per document."""
    values = torch.randn(12, dtype=torch.float64, requires_grad=True)
    cu = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    out = kernels.segment_sum(values, cu)
    expected = torch.stack([values[0:3].sum(), values[3:4].sum(), values[4:10].sum()])
    torch.testing.assert_close(out, expected)
    (grad,) = torch.autograd.grad((out * torch.tensor([1.0, 2.0, 3.0],
                                                       dtype=torch.float64)).sum(), values)
    assert grad.tolist() == [1.0] * 3 + [2.0] + [3.0] * 6 + [0.0] * 2


def test_segment_sum_of_logprobs_matches_per_document_reference():
    """Sequence log-probs of packed documents from the op's per-token output (fp32 values)."""
    hidden, weight, targets = _data(11, 24, 97, torch.float32, ignore_every=4)
    cu = torch.tensor([0, 5, 5, 11])  # an empty document in the middle
    with torch.no_grad(), kernels.backend("triton"):
        seq = kernels.segment_sum(kernels.token_logprobs(hidden, weight, targets), cu)
    ref = kernels.token_logprobs_reference(hidden, weight, targets).detach()
    assert seq.dtype == torch.float32 and seq.shape == (3,) and seq[1] == 0
    torch.testing.assert_close(seq, torch.stack([ref[:5].sum(), ref[5:5].sum(), ref[5:].sum()]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kw", [{}, {"softcap": 4.0, "temperature": 1.6},
                                {"temperature": 0.7}])
@pytest.mark.parametrize("chunk_rows", [None, 3])
def test_grad_in_forward_matches_reference_and_recompute(dtype, kw, chunk_rows, monkeypatch):
    """A frozen head, logp alone: d logp / d hidden formed in the forward (grad_in_forward, the
    default) equals the reference and the recomputing backward; several chunks with a short
    last one; ignored rows get no gradient."""
    V = 333
    if chunk_rows:
        row_bytes = V * torch.empty((), dtype=dtype).element_size()
        monkeypatch.setitem(ce.CHUNK_BYTES, "default", chunk_rows * row_bytes)
    hidden, weight, targets = _data(11, 40, V, dtype, ignore_every=4)
    weight.requires_grad_(False)
    _check(hidden, weight, targets, **kw)  # the default (in forward) against the reference
    up = [torch.randn(11)]
    outs = {}
    for on in (True, False):
        outs[on] = _outputs_and_grads("triton", hidden, weight, targets, up,
                                      grad_in_forward=on, **kw)
    torch.testing.assert_close(outs[True][0], outs[False][0], rtol=0, atol=0)
    rtol, atol = (1e-6, 1e-6) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(outs[True][1], outs[False][1], rtol=rtol, atol=atol)
    ignored = targets == IGNORE
    assert not outs[True][1][0][ignored].any()


def test_grad_in_forward_runs_no_product_in_backward(monkeypatch):
    """On: the forward runs 2 products per chunk (logits, d logp / d h) and backward none;
    off: 1 in the forward and 2 per chunk in backward (logits again, grad_hidden). With the
    entropy asked for or a head that trains, the recomputing backward is used either way."""
    V = 100
    monkeypatch.setitem(ce.CHUNK_BYTES, "default", 4 * V * 4)  # 10 rows: 3 chunks
    hidden, weight, targets = _data(10, 24, V, torch.float32)
    weight.requires_grad_(False)
    calls = []
    orig = torch.mm

    def mm(*a, **k):
        calls.append(1)
        return orig(*a, **k)
    monkeypatch.setattr(torch, "mm", mm)
    for on, fwd, bwd in ((True, 6, 0), (False, 3, 6)):
        calls.clear()
        with kernels.backend("triton"):
            logp = kernels.token_logprobs(hidden, weight, targets, grad_in_forward=on)
        assert len(calls) == fwd
        calls.clear()
        logp.sum().backward()
        assert len(calls) == bwd
        hidden.grad = None
    with kernels.backend("triton"):
        logp, ent = kernels.token_logprobs(hidden, weight, targets, return_entropy=True,
                                           grad_in_forward=True)
    assert type(logp.grad_fn).__name__.startswith("_TokenLogprobsFunction")
    weight.requires_grad_(True)
    with kernels.backend("triton"):
        logp = kernels.token_logprobs(hidden, weight, targets, grad_in_forward=True)
    assert type(logp.grad_fn).__name__.startswith("_TokenLogprobsFunction")


def test_grad_in_forward_unused_output():
    """The log-probs computed but not used by the loss: the hidden states get zero gradient."""
    hidden, weight, targets = _data(5, 16, 133, torch.float32)
    weight.requires_grad_(False)
    with kernels.backend("triton"):
        logp = kernels.token_logprobs(hidden, weight, targets)
    (g,) = torch.autograd.grad((logp * 0).sum() + hidden.sum() * 0, [hidden])
    assert not g.any()


def test_grad_in_forward_env_switch(monkeypatch):
    """LEANTUNE_LOGP_GRAD_IN_FORWARD=0 takes the recomputing backward (read at each call); a
    value that is neither on nor off is refused."""
    hidden, weight, targets = _data(5, 16, 133, torch.float32)
    weight.requires_grad_(False)
    for raw, name in (("0", "_TokenLogprobsFunction"), ("on", "_TokenLogprobsGradInForward")):
        monkeypatch.setenv("LEANTUNE_LOGP_GRAD_IN_FORWARD", raw)
        with kernels.backend("triton"):
            logp = kernels.token_logprobs(hidden, weight, targets)
        assert type(logp.grad_fn).__name__.startswith(name)
    monkeypatch.setenv("LEANTUNE_LOGP_GRAD_IN_FORWARD", "maybe")
    with pytest.raises(ValueError, match="LEANTUNE_LOGP_GRAD_IN_FORWARD"), \
            kernels.backend("triton"):
        kernels.token_logprobs(hidden, weight, targets)


def test_grad_in_forward_strided_input_and_retain_graph():
    """A non-contiguous hidden gets its gradient in its own layout; backward twice (retained
    graph) adds the same gradient twice (nothing is scaled in place); no rows: empty outputs."""
    base, weight, targets = _data(6, 32, 133, torch.float32)
    weight.requires_grad_(False)
    wide = torch.stack([base.detach(), base.detach()], 2).reshape(6, 64).requires_grad_()
    hidden = wide[:, ::2]  # [6, 32] = base, strided
    assert not hidden.is_contiguous()
    up = torch.randn(6)
    with kernels.backend("triton"):
        logp = kernels.token_logprobs(hidden, weight, targets)
    (logp * up).sum().backward(retain_graph=True)
    once = wide.grad.clone()
    (logp * up).sum().backward()
    torch.testing.assert_close(wide.grad, 2 * once)
    ref_h = base.detach().clone().requires_grad_()
    with kernels.backend("reference"):
        (kernels.token_logprobs(ref_h, weight, targets) * up).sum().backward()
    torch.testing.assert_close(once[:, ::2], ref_h.grad, rtol=1e-5, atol=1e-5)
    assert not once[:, 1::2].any()
    empty = torch.empty(0, 32, requires_grad=True)
    with kernels.backend("triton"):
        out = kernels.token_logprobs(empty, weight, targets[:0])
    out.sum().backward()
    assert out.shape == (0,) and empty.grad.shape == (0, 32)
