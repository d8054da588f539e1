"""Triton decode attention over the KV cache (the Triton interpreter on CPU) against today's
cache path (SDPA with the KVCache's own mask) and a dense reference; the model's switch; greedy
decoding gives the same tokens with the kernel on and off."""

from __future__ import annotations

import importlib
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401  (autouse)

from leantune import kernels
from leantune.generate.cache import KVCache
from leantune.generate.decode import decode
from leantune.kernels.decode_attention import (
    decode_attention,
    decode_attention_on,
    decode_attention_reference,
    split_count,
)
from leantune.model.attention import cache_attention

# the module (the package's `decode_attention` is the function)
dattn_module = importlib.import_module("leantune.kernels.decode_attention")

S = 37  # slots: not a multiple of any block


def _cache(B, Hk, D, window, pad, start, dtype=torch.float32):
    """A KVCache of one layer (random k/v in every slot: the kernel must ignore the unseen
    ones), its pad and start set as generate/decode.py sets them."""
    cfg = SimpleNamespace(num_key_value_heads=Hk, head_dim=D, num_hidden_layers=1,
                          window_for_layer=lambda i: window)
    cache = KVCache(cfg, B, S, dtype, torch.device("cpu"))
    cache.k[0].normal_()
    cache.v[0].normal_()
    cache.pad.copy_(torch.tensor(pad))
    cache.start.fill_(start)
    return cache


CASES = [  # (T, Hq, Hk, D, window, pad, start)
    (1, 4, 2, 16, None, [0, 5], 20),   # a decode step, rows padded differently, GQA 4:2
    (3, 3, 1, 32, None, [2, 0], 20),   # 3 new tokens, GQA 3:1
    (1, 4, 2, 32, 5, [0, 7], 20),      # window smaller than the filled part
    (3, 3, 1, 16, 4, [9, 1], 18),
    (3, 4, 2, 16, None, [0, 4], 2),    # prefill-like: row 1's first queries are padding
    (2, 2, 2, 16, 3, [0, 3], 35),      # the last slots of the cache
]


@pytest.mark.parametrize("splits", [None, 3])
@pytest.mark.parametrize("T,Hq,Hk,D,window,pad,start", CASES)
def test_matches_the_cache_mask_path_and_the_dense_reference(T, Hq, Hk, D, window, pad, start,
                                                             splits):
    B = len(pad)
    cache = _cache(B, Hk, D, window, pad, start)
    _, meta = cache.meta(T)
    q = torch.randn(B, T, Hq, D)
    k, v = cache.k[0], cache.v[0]
    scale = D ** -0.5
    with kernels.backend("triton"):
        got = decode_attention(q, k, v, cache.pad, cache.start, window, scale, splits=splits)
    today = cache_attention(q, k, v, meta.masks[window], scale)  # SDPA with the cache's mask
    dense = decode_attention_reference(q, k, v, cache.pad, cache.start, window, scale)
    torch.testing.assert_close(got, today, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, dense, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dense, today, rtol=1e-5, atol=1e-5)


def test_unwritten_slots_are_never_read():
    """NaN after the newest token (and before the lowest seen slot) changes nothing."""
    cache = _cache(2, 2, 16, 4, [0, 3], 20)
    k, v = cache.k[0].clone(), cache.v[0].clone()
    q = torch.randn(2, 3, 4, 16)
    with kernels.backend("triton"):
        ref = decode_attention(q, k, v, cache.pad, cache.start, 4, 0.25, splits=3)
        for t in (k, v):
            t[:, 23:] = float("nan")
            t[:, :17] = float("nan")  # slot 17 is the first one query 0 (slot 20) sees
        got = decode_attention(q, k, v, cache.pad, cache.start, 4, 0.25, splits=3)
    assert torch.equal(got, ref)


def test_bf16_and_strided_queries():
    """bf16 (fp32 softmax, weights rounded to bf16 before P @ V as flash kernels do) and q a
    view of a fused projection output."""
    cache = _cache(2, 2, 16, None, [0, 6], 20, torch.bfloat16)
    qkv = torch.randn(2, 1, 4 + 2 * 2, 16, dtype=torch.bfloat16)
    q = qkv[:, :, :4]
    with kernels.backend("triton"):
        got = decode_attention(q, cache.k[0], cache.v[0], cache.pad, cache.start, None, 0.25)
    ref = decode_attention_reference(q, cache.k[0], cache.v[0], cache.pad, cache.start, None,
                                     0.25)
    torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)


def test_split_count_depends_on_static_shapes_only():
    cpu = torch.device("cpu")  # (2 "multiprocessors" here)
    assert split_count(1, 8, 256, cpu) == 1  # short cache: one kernel
    assert split_count(1, 1, 4096, cpu) == 2
    assert split_count(4, 8, 4096, cpu) == 1


def test_cache_attention_switch(monkeypatch):
    """The cache path calls the kernel where Triton runs, T <= MAX_TOKENS and the switch is on;
    LEANTUNE_DECODE_ATTENTION=0, the reference backend or a long T keep SDPA."""
    cache = _cache(2, 2, 16, None, [0, 5], 20)
    _, meta = cache.meta(1)
    q = torch.randn(2, 1, 4, 16)
    calls = []
    real = dattn_module.decode_attention

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(dattn_module, "decode_attention", counted)
    args = (q, cache.k[0], cache.v[0], meta.masks[None], 0.25, cache, None)
    ref = cache_attention(*args[:5])
    with kernels.backend("triton"):
        got = cache_attention(*args)
        assert calls == [1]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        monkeypatch.setenv("LEANTUNE_DECODE_ATTENTION", "0")
        assert not decode_attention_on(q)
        cache_attention(*args)
        assert calls == [1]
        monkeypatch.setenv("LEANTUNE_DECODE_ATTENTION", "1")
        assert not decode_attention_on(torch.randn(2, 17, 4, 16))  # prefill: SDPA's job
    with kernels.backend("reference"):
        assert not decode_attention_on(q)


@pytest.mark.parametrize("family", ["mistral", "llama"])
def test_greedy_decoding_is_the_same_with_the_kernel_on_and_off(family, monkeypatch):
    """A tiny model (GQA 4:2, head_dim 12; mistral: window 6 < the 9-token prompt + 6 new),
    prompts of different lengths (left padding): the same tokens. Only this op is sent to
    Triton (the interpreter), the rest of the model stays on its reference kernels."""
    model = model_for(CONFIGS[family]).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15, 16]]
    calls = []
    real = dattn_module._launch

    def counted(*a):
        calls.append(a[0].shape[1])
        return real(*a)

    monkeypatch.setattr(dattn_module, "_launch", counted)
    monkeypatch.setattr(dattn_module, "use_triton", lambda t: True)
    monkeypatch.setenv("LEANTUNE_DECODE_ATTENTION", "0")
    off = decode(model, prompts, 6)
    assert calls == []
    monkeypatch.setenv("LEANTUNE_DECODE_ATTENTION", "1")
    on = decode(model, prompts, 6)
    layers = CONFIGS[family]["num_hidden_layers"]
    assert calls == [9] * layers + [1] * 5 * layers  # the prefill (9 tokens) and 5 steps
    assert [r.token_ids for r in on] == [r.token_ids for r in off]


ON_GPU = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.mark.skipif(not ON_GPU, reason="compiled kernels: a GPU with TRITON_INTERPRET=0")
@pytest.mark.parametrize("slots", [256, 1024])  # one kernel; chunks and the merge kernel
@pytest.mark.parametrize("T,window", [(1, None), (4, None), (1, 100)])
def test_gpu_matches_and_is_captured_in_a_cuda_graph(slots, T, window):
    """The Llama-3.1-8B attention shape (32 q heads over 8 kv heads, head_dim 128) in bf16:
    the reference's values, then captured once and replayed after moving `start` on the
    device. Run: TRITON_INTERPRET=0 pytest tests/kernels/test_decode_attention.py -k gpu"""
    dev = torch.device("cuda")
    B, Hq, Hk, D = 2, 32, 8, 128
    k = torch.randn(B, slots, Hk, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    q = torch.randn(B, T, Hq, D, device=dev, dtype=torch.bfloat16)
    pad = torch.tensor([0, 30], device=dev)
    start = torch.tensor([100], device=dev)
    for _ in range(2):  # compile outside the capture
        decode_attention(q, k, v, pad, start, window, D ** -0.5)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, pad, start, window, D ** -0.5)
    for s in (100, slots // 2 + 3, slots - T):
        start.fill_(s)
        graph.replay()
        ref = decode_attention_reference(q, k, v, pad, start, window, D ** -0.5)
        torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(decode_attention(q.float(), k.float(), v.float(), pad, start,
                                                    window, D ** -0.5),
                                   decode_attention_reference(q.float(), k.float(), v.float(),
                                                              pad, start, window, D ** -0.5),
                                   rtol=1e-4, atol=1e-4)
