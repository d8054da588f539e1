"""Shared-prompt attention (DPO pairs) on flash attention against cuDNN, one layer's call.

Issue 20's DPO step packs a pair as [prompt | chosen | rejected] with the prompt once
(data/preference.py _pack_shared): query segments [prompt + chosen] (causal over themselves) and
[rejected] (over the gathered [prompt + rejected] keys, bottom-right causal). Today that is one
flash-attention-2 varlen call over gathered k/v (engine/attention.py). cuDNN runs causal
attention over whole rows ~1.8x faster than flash on an H200, but it takes no bottom-right
causal segments, so this times the same attention split into calls it does take, merged by
their log-sum-exps (exact; backward gets the merged output and log-sum-exp):

    A  [prompt + chosen] over itself, causal                (equal lengths)
    B  [rejected] over [prompt], no mask
    C  [rejected] over itself, causal                       (equal lengths)
    rejected = merge(B, C)

Measured on an H100 (BENCHMARKS.md 2026-12-07, seventeenth session) the split loses: per layer
flash 0.29 ms forward + 1.03 backward, the cuDNN split 0.57 + 0.83 (and a general split over
flash varlen 0.58 + 1.16; cuDNN's ragged op gave wrong results), so the engine keeps the one
flash call and this script keeps the comparison.

Variants, each checked against the flash path (largest |difference| of out, dq, dk, dv):
    flash-shared   the engine's AttentionBackend over the shared-prompt batch (what runs now)
    cudnn-dense    the split on [B, T] views (uniform pair lengths, one pair a row: what the
                   general case could gain at most)

    PYTHONPATH=src python bench/gpu_shared_attention.py [--pairs 4 --prompt 512 --completion 512]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from leantune.data.preference import PreferencePair, _pack_shared  # noqa: E402
from leantune.engine.attention import AttentionBackend  # noqa: E402
from leantune.engine.options import EngineOptions  # noqa: E402
from leantune.model.attention import AttentionMeta, repeat_kv_heads  # noqa: E402

from harness import mean_ms as timed  # noqa: E402


def bhtd(t):
    return t.transpose(1, 2)


def cudnn_fwd(q, k, v, causal, scale):
    """Dense cuDNN: q [B, Tq, H, D], k/v [B, Tk, Hk, D] (GQA by repeated heads) -> (out
    [B, Tq, H, D], lse [B, H, Tq], rest)."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k, v = repeat_kv_heads(k, rep), repeat_kv_heads(v, rep)
    out, lse, *rest = torch.ops.aten._scaled_dot_product_cudnn_attention(
        bhtd(q), bhtd(k), bhtd(v), None, True, 0.0, causal, False, scale=scale)
    return bhtd(out), lse.reshape(lse.shape[0], lse.shape[1], -1), (k, v, rest)


def cudnn_bwd(dout, q, kv_rest, out, lse, causal, scale, hk):
    k, v, rest = kv_rest
    cq, ck, mq, mk, seed, offset, _ = rest
    dq, dk, dv = torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        bhtd(dout), bhtd(q), bhtd(k), bhtd(v), bhtd(out), lse[..., None].contiguous(), seed,
        offset, None, cq, ck, mq, mk, 0.0, causal, scale=scale)
    dq, dk, dv = bhtd(dq), bhtd(dk), bhtd(dv)
    rep = dk.shape[2] // hk
    if rep > 1:
        dk = dk.reshape(*dk.shape[:2], hk, rep, dk.shape[-1]).sum(3)
        dv = dv.reshape(*dv.shape[:2], hk, rep, dv.shape[-1]).sum(3)
    return dq, dk, dv


def merge(o1, l1, o2, l2):
    """Two partial attentions over disjoint keys -> the whole: out [.., T, H, D] (l: [.., H, T])."""
    lse = torch.logaddexp(l1, l2)
    w1 = torch.exp(l1 - lse).transpose(-1, -2)[..., None]
    w2 = torch.exp(l2 - lse).transpose(-1, -2)[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype), lse


def dense_split(q, k, v, Lp, Lc, scale, hk):
    """cuDNN split on [B, T] views, one pair per row [prompt | chosen | rejected]."""
    pc, r0 = Lp + Lc, Lp + Lc
    oA, lA, rA = cudnn_fwd(q[:, :pc], k[:, :pc], v[:, :pc], True, scale)
    oB, lB, rB = cudnn_fwd(q[:, r0:], k[:, :Lp], v[:, :Lp], False, scale)
    oC, lC, rC = cudnn_fwd(q[:, r0:], k[:, r0:], v[:, r0:], True, scale)
    oR, lR = merge(oB, lB, oC, lC)
    out = torch.cat([oA, oR], 1)

    def backward(dout):
        dqA, dkA, dvA = cudnn_bwd(dout[:, :pc], q[:, :pc], rA, oA, lA, True, scale, hk)
        dqB, dkB, dvB = cudnn_bwd(dout[:, r0:], q[:, r0:], rB, oR, lR, False, scale, hk)
        dqC, dkC, dvC = cudnn_bwd(dout[:, r0:], q[:, r0:], rC, oR, lR, True, scale, hk)
        dkA[:, :Lp] += dkB
        dvA[:, :Lp] += dvB
        return (torch.cat([dqA, dqB + dqC], 1), torch.cat([dkA, dkC], 1),
                torch.cat([dvA, dvC], 1))

    return out, backward


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--completion", type=int, default=512)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32, help="per-step estimate: layers x passes")
    args = ap.parse_args()
    dev = torch.device("cuda")
    P, Lp, Lc = args.pairs, args.prompt, args.completion
    pairs = [PreferencePair(list(range(3, 3 + Lp)), list(range(3, 3 + Lc)),
                            list(range(3, 3 + Lc))) for _ in range(P)]
    batch, _, _ = _pack_shared(pairs, Lp + Lc, 0, 8)
    B, T = batch.input_ids.shape
    meta = AttentionMeta.build((B, T), dev, batch.seq_lens, batch.cu_seqlens, batch.max_seqlen,
                               {None}, kv_index=batch.kv_index, cu_seqlens_k=batch.cu_seqlens_k,
                               max_seqlen_k=batch.max_seqlen_k, seq_lens_k=batch.seq_lens_k)
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    scale = D ** -0.5
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, T, Hk, D, device=dev, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, T, Hk, D, device=dev, dtype=torch.bfloat16, generator=g)
    dout = torch.randn(B, T, H, D, device=dev, dtype=torch.bfloat16, generator=g)
    print(f"{P} pairs of {Lp} + {Lc} + {Lc} tokens packed as [{B}, {T}]; heads {H}/{Hk} x {D}",
          flush=True)

    backend = AttentionBackend(EngineOptions())
    rows = []

    def flash_fwd():
        return backend.forward(q, k, v, meta, None, scale)

    out, st = flash_fwd()
    ref = (out, *backend.backward(dout, q, k, v, out, st, meta, None, scale))
    f = timed(flash_fwd)
    b = timed(lambda: backend.backward(dout, q, k, v, out, st, meta, None, scale))
    rows.append(("flash-shared", f, b, 0.0))

    if T == 2 * Lc + Lp and B == P:
        try:
            o2, bwd = dense_split(q, k, v, Lp, Lc, scale, Hk)
            got = (o2, *bwd(dout))
            err = max(((a.float() - b_.float()).abs().max() / b_.float().abs().max()).item()
                      for a, b_ in zip(got, ref))
            f2 = timed(lambda: dense_split(q, k, v, Lp, Lc, scale, Hk))
            b2 = timed(lambda: bwd(dout))
            rows.append(("cudnn-dense", f2, b2, err))
        except RuntimeError as e:
            print(f"cudnn-dense: {str(e).splitlines()[0][:200]}", flush=True)

    print("\n| variant | fwd ms | bwd ms | rel. err vs flash | step estimate ms "
          f"({args.layers} layers: 2 fwd + 1 bwd) |\n|---|---|---|---|---|")
    for name, f, b, err in rows:
        est = args.layers * (2 * f + b)
        print(f"| {name} | {f:.3f} | {b:.3f} | {err:.2e} | {est:.1f} |")
        print(json.dumps({"bench": "shared_attention", "variant": name, "fwd_ms": f,
                          "bwd_ms": b, "rel_err": err, "step_ms": est, "pairs": P,
                          "prompt": Lp, "completion": Lc}), flush=True)


if __name__ == "__main__":
    main()
