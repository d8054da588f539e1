"""Soft-capped attention (Gemma 2) as Triton kernels, through the interpreter: out, lse, dq, dk
and dv of the model's entry points (model/softcap_attention.py, which chooses the kernels for
the varlen and causal paths) against (a) the PyTorch query blocks they replace and (b) the whole
[T, T] scores under autograd, fp32 within 1e-5, on small odd shapes: T not a multiple of the
block, several documents a row, a padding segment, windows shorter than a document, GQA 4:2 and
3:1, D 16 and 32, unequal query/key blocks, the mask-free key blocks split off or not, q/k/v
as strided views of one projection buffer;
and a tiny Gemma 2 on packed rows (varlen path, D 12) whose loss and LoRA gradients, plain
autograd (the kernels' autograd.Function) and the engine, equal those of the query blocks.
(bf16 is checked on the GPU by bench/gpu_softcap.py: the interpreter's bf16 tl.dot is wrong.)"""

from __future__ import annotations

import pytest
import torch
from helpers import BASE, check, loss_and_grads, model_for, one_torch_thread  # noqa: F401
from helpers import packed_batch

from leantune import kernels
from leantune.kernels import softcap_attention as kernel
from leantune.model import softcap_attention as blocked
from leantune.model.attention import AttentionMeta

SCALE, CAP = 0.3, 2.0
TOL = dict(rtol=1e-5, atol=1e-5)

# (B, T, Hq, Hk, D, segment lengths (None: one document a row), path, window, kernel blocks:
# (BLOCK_M, BLOCK_N[, split]), None: 16 x 16 with the mask-free blocks split off)
CASES = {
    "docs_gqa42_d16": (2, 37, 4, 2, 16, [10, 20, 7, 37], "varlen", None, None),
    "docs_window_gqa31_d32": (2, 45, 3, 1, 32, [5, 30, 10, 40, 5], "varlen", 6, None),
    "pad_window_blocks16x32": (1, 70, 4, 2, 16, [23, 31, 16], "varlen", 9, (16, 32)),
    "docs_blocks32x16": (1, 53, 3, 1, 16, [1, 19, 33], "varlen", 20, (32, 16)),
    "varlen_rows_window": (2, 41, 4, 2, 16, None, "varlen", 13, None),
    "causal": (2, 39, 4, 2, 32, None, "causal", None, None),
    "causal_window": (1, 50, 3, 1, 16, None, "causal", 11, None),
    "docs_window_no_split": (2, 45, 3, 1, 16, [5, 30, 10, 40, 5], "varlen", 6, (16, 16, 0)),
    "causal_no_split": (1, 50, 4, 2, 16, None, "causal", None, (16, 32, 0)),
}


def _inputs(B, T, Hq, Hk, D, seed=0):
    """q, k, v as views of one [B, T, (Hq + 2 Hk) D] projection output (as in the layer) and a
    random output gradient."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=g) * 2
    q = qkv[..., :Hq * D].view(B, T, Hq, D)
    k = qkv[..., Hq * D:(Hq + Hk) * D].view(B, T, Hk, D)
    v = qkv[..., (Hq + Hk) * D:].view(B, T, Hk, D)
    return q, k, v, torch.randn(B, T, Hq, D, generator=g)


def _meta(B, T, lens, path, window):
    return AttentionMeta.build((B, T), torch.device("cpu"), seq_lens=lens, cu_seqlens=None,
                               max_seqlen=max(lens or [T]), windows={window}, path=path)


def _kernel_blocks(monkeypatch, blocks):
    """Force the kernels' (BLOCK_M, BLOCK_N[, split]): `blocks` forward and for dq, the other
    way round for dk/dv."""
    if blocks is not None:
        m, n, split = (*blocks, 1)[:3]
        monkeypatch.setenv("LEANTUNE_SOFTCAP_FWD", f"{m},{n},1,1,{split}")
        monkeypatch.setenv("LEANTUNE_SOFTCAP_DQ", f"{m},{n},1,1,{split}")
        monkeypatch.setenv("LEANTUNE_SOFTCAP_DKDV", f"{n},{m},1,1,{split}")


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_the_query_blocks_and_the_whole_scores(case, monkeypatch):
    B, T, Hq, Hk, D, lens, path, window, blocks = CASES[case]
    q, k, v, do = _inputs(B, T, Hq, Hk, D)
    meta = _meta(B, T, lens, path, window)
    _kernel_blocks(monkeypatch, blocks)
    calls = []
    monkeypatch.setattr(kernel, "softcap_attention_fwd",
                        lambda *a, fwd=kernel.softcap_attention_fwd: calls.append(1) or fwd(*a))
    with kernels.backend("triton"):
        out, lse = blocked.softcap_attention_forward(q, k, v, meta, window, SCALE, CAP)
        grads = blocked.softcap_attention_backward(do, q, k, v, out, lse, meta, window, SCALE,
                                                   CAP)
    assert calls, "the kernel did not run"

    # (a) today's PyTorch query blocks (blocks of 8 queries)
    with kernels.backend("reference"):
        ref_out, ref_lse = blocked.softcap_attention_forward(q, k, v, meta, window, SCALE, CAP,
                                                             block=8)
        ref_grads = blocked.softcap_attention_backward(do, q, k, v, ref_out, ref_lse, meta,
                                                       window, SCALE, CAP, block=8)
    torch.testing.assert_close(out, ref_out, **TOL)
    torch.testing.assert_close(lse, ref_lse, **TOL)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL)

    # (b) the whole [T, T] scores under autograd, masked as the metadata's "mask" path masks
    start, _ = blocked._doc_bounds(meta, B, T, q.device)
    masks = _meta(B, T, lens, "mask", window).masks[window]
    assert torch.equal(kernel.visible_keys(start, B, T, window, q.device), masks)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    dense_out, dense_lse = kernel.softcap_attention_reference(*leaves, window, SCALE, CAP, start)
    dense_out.backward(do)
    torch.testing.assert_close(out, dense_out.detach(), **TOL)
    torch.testing.assert_close(lse, dense_lse.detach(), **TOL)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, **TOL)


def test_switch_and_paths_keep_the_query_blocks(monkeypatch):
    """LEANTUNE_SOFTCAP_KERNEL=0, the "mask" path and CPU tensors under the "auto" backend keep
    the PyTorch query blocks; the kernel runs otherwise."""
    B, T, Hq, Hk, D = 1, 19, 2, 1, 16
    q, k, v, _ = _inputs(B, T, Hq, Hk, D)

    def refuse(*a, **kw):
        raise AssertionError("the kernel ran")

    monkeypatch.setattr(kernel, "softcap_attention_fwd", refuse)
    lens = [7, 12]
    runs = [("varlen", "triton", "0"), ("mask", "triton", "1"), ("varlen", "auto", "1")]
    for path, backend, switch in runs:
        monkeypatch.setenv("LEANTUNE_SOFTCAP_KERNEL", switch)
        with kernels.backend(backend):
            blocked.softcap_attention_forward(q, k, v, _meta(B, T, lens, path, 5), 5, SCALE, CAP)
    monkeypatch.setenv("LEANTUNE_SOFTCAP_KERNEL", "1")
    with kernels.backend("triton"), pytest.raises(AssertionError, match="the kernel ran"):
        blocked.softcap_attention_forward(q, k, v, _meta(B, T, lens, "varlen", 5), 5, SCALE, CAP)


def test_document_bounds_from_cu_seqlens():
    """Each token's document start / end within its row, padding a document of its own."""
    meta = _meta(2, 6, [2, 3, 1, 6], "varlen", None)
    start, end = blocked._doc_bounds(meta, 2, 6, torch.device("cpu"))
    assert start.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6]
    assert end.tolist() == [[2, 2, 5, 5, 5, 6], [6] * 6]
    assert blocked._doc_bounds(_meta(2, 6, None, "varlen", None), 2, 6, "cpu") == (None, None)


def test_supports():
    """The kernels take one dtype, D <= 256, int32 offsets within a row (meta tensors: no
    memory)."""
    def qkv(T, D, dtype=torch.float32, kv_dtype=None):
        q = torch.empty(1, T, 2, D, device="meta", dtype=dtype)
        kv = torch.empty(1, T, 1, D, device="meta", dtype=kv_dtype or dtype)
        return q, kv, kv

    assert kernel.supports(*qkv(64, 256)) and kernel.supports(*qkv(64, 16, torch.bfloat16))
    assert not kernel.supports(*qkv(64, 512))
    assert not kernel.supports(*qkv(64, 32, torch.float32, torch.bfloat16))
    assert not kernel.supports(*qkv(2**26, 32))  # 2^26 tokens x 64 values a token


GEMMA2 = dict(BASE, model_type="gemma2", query_pre_attn_scalar=20, sliding_window=5,
              num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
              attn_logit_softcapping=5.0, final_logit_softcapping=3.0)


def test_gemma2_model_and_engine_with_the_kernels(monkeypatch):
    from leantune.engine import LayerPlan

    model = model_for(GEMMA2)
    model.attention_path = "varlen"  # packed rows: the path the kernels take
    batch = packed_batch()
    monkeypatch.setenv("LEANTUNE_SOFTCAP_KERNEL", "0")
    ref_loss, ref_grads = loss_and_grads(model, batch)
    monkeypatch.setenv("LEANTUNE_SOFTCAP_KERNEL", "1")
    monkeypatch.setattr(blocked, "use_triton", lambda t: True)  # this op's kernels alone
    calls = []
    monkeypatch.setattr(kernel, "softcap_attention_bwd",
                        lambda *a, bwd=kernel.softcap_attention_bwd: calls.append(1) or bwd(*a))
    loss, grads = loss_and_grads(model, batch)
    assert len(calls) == 2  # one backward a layer: autograd went through the kernels
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grads, ref_grads, **TOL)
    check(model, [LayerPlan(keep=1)] * 2, atol=1e-5)  # the engine (kernels) vs autograd
    assert len(calls) > 4
