"""engine/prefix_split.py: shared-prompt attention as two plain calls merged by their
log-sum-exps equals the model's attention over the shared-prompt masks, forward and backward
(the per-segment reference calls on the CPU; cuDNN / flash run the same split on CUDA:
bench/gpu_shared_attention.py)."""

import pytest
import torch

from leantune.data.preference import PreferencePair, _pack_shared
from leantune.engine.options import EngineOptions
from leantune.engine.prefix_split import split_backward, split_forward
from leantune.model.attention import AttentionMeta, PrefixSplit, attention


def _batch(lengths, max_seq_len=32):
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, 50, (n,), generator=g).tolist()

    pairs = [PreferencePair(ids(p), ids(c), ids(r)) for p, c, r in lengths]
    return _pack_shared(pairs, max_seq_len, 0, 8)[0]


def _meta(batch, path):
    B, T = batch.input_ids.shape
    return AttentionMeta.build((B, T), torch.device("cpu"), batch.seq_lens, batch.cu_seqlens,
                               batch.max_seqlen, {None}, dtype=torch.float32, path=path,
                               kv_index=batch.kv_index, cu_seqlens_k=batch.cu_seqlens_k,
                               max_seqlen_k=batch.max_seqlen_k, seq_lens_k=batch.seq_lens_k)


@pytest.mark.parametrize("lengths,heads", [
    ([(5, 7, 3), (9, 2, 6), (1, 4, 4)], (4, 2)),   # odd lengths, padding, GQA
    ([(11, 13, 13)], (3, 3)),                      # one pair, no GQA
    ([(4, 1, 1), (2, 6, 9)], (6, 2)),
])
def test_split_equals_the_masked_attention(lengths, heads):
    batch = _batch(lengths)
    B, T = batch.input_ids.shape
    Hq, Hk = heads
    D = 8
    ref_meta, meta = _meta(batch, "mask"), _meta(batch, "varlen")
    assert meta.prefix_split is not None
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, T, h, D, generator=g, dtype=torch.float64).float()
               for h in (Hq, Hk, Hk))
    dout = torch.randn(B, T, Hq, D, generator=g)
    scale = D ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attention(*leaves, ref_meta, None, scale)
    want_grads = torch.autograd.grad(want, leaves, dout)

    out, state = split_forward("reference", q, k, v, meta, scale)
    grads = split_backward(dout, q, k, v, out, state, meta, scale)
    real = torch.zeros(B * T, dtype=torch.bool)  # padding rows attend among themselves only
    for s in range(len(batch.seq_lens)):
        a, b = int(batch.cu_seqlens[s]), int(batch.cu_seqlens[s + 1])
        if batch.seq_lens_k[s] > 0 and batch.input_ids.view(-1)[a:b].ne(0).any():
            real[a:b] = True
    torch.testing.assert_close(out.view(B * T, Hq, D)[real], want.view(B * T, Hq, D)[real],
                               atol=1e-5, rtol=1e-5)
    for got, ref in zip(grads, want_grads):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_prefix_rows_are_each_rejected_segments_prompt():
    batch = _batch([(5, 7, 3), (9, 2, 6)])
    ps = PrefixSplit.build(batch.seq_lens, batch.seq_lens_k, torch.device("cpu"))
    # pair 0 at rows 0..14: prompt 0..4, chosen 5..11, rejected 12..14; pair 1 follows
    # (first-fit decreasing puts the longer pair first)
    lens = [(9, 2, 6), (5, 7, 3)]
    q_rows, prefix_rows, start = [], [], 0
    for p, c, r in lens:
        q_rows += range(start + p + c, start + p + c + r)
        prefix_rows += range(start, start + p)
        start += p + c + r
    assert ps.q_rows.tolist() == q_rows and ps.prefix_rows.tolist() == prefix_rows
    assert ps.cu_q.tolist() == [0, 6, 9] and ps.cu_k.tolist() == [0, 9, 14]
    assert (ps.max_q, ps.max_k) == (6, 9)


def test_unshared_batches_have_no_split():
    assert PrefixSplit.build([4, 4], [4, 4], torch.device("cpu")) is None


def test_the_switch_is_an_engine_option_off_by_default(monkeypatch):
    assert EngineOptions().split_shared_attention is False
    monkeypatch.setenv("LEANTUNE_SPLIT_SHARED_ATTENTION", "1")
    opts, names = EngineOptions().with_env_overrides()
    assert opts.split_shared_attention is True and names == ["split_shared_attention"]
