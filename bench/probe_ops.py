"""Micro-measurements behind the fused layer's design choices, at the Llama-3.1-8B step shape
(8192 tokens): cuDNN attention called through its aten ops (native GQA, backward from the kept
log-sum-exp), GEMM rates for plain vs accumulating (addmm) products and for MLP row chunks, the
LoRA side products, host<->device copies one way and both ways at once, and our Triton GLU and
RMSNorm kernels. Prints one JSON line per measurement (bench/harness.record).

    python bench/probe_ops.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import mean_ms, record  # noqa: E402

DEV = torch.device("cuda")
BF = torch.bfloat16


def timed(fn, n=20, warm=3) -> float:
    return mean_ms(fn, n, warm)


def cudnn_ops(B=4, T=2048, Hq=32, Hk=8, D=128):
    """cuDNN attention through aten (the engine's backend): forward keeping the log-sum-exp,
    backward from it, against SDPA's cuDNN backend under autograd."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from leantune.engine import AttentionBackend, EngineOptions
    from leantune.model.attention import AttentionMeta, repeat_kv_heads

    scale = D ** -0.5
    q = torch.randn(B, T, Hq, D, device=DEV, dtype=BF)
    k = torch.randn(B, T, Hk, D, device=DEV, dtype=BF)
    v = torch.randn_like(k)
    dout = torch.randn_like(q)
    res = {}

    def sdpa_cudnn(q, k, v):
        rep = Hq // Hk
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            o = torch.nn.functional.scaled_dot_product_attention(
                q.transpose(1, 2), repeat_kv_heads(k, rep).transpose(1, 2),
                repeat_kv_heads(v, rep).transpose(1, 2), is_causal=True, scale=scale)
        return o.transpose(1, 2)

    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    ref = sdpa_cudnn(*leaves)
    ref_g = torch.autograd.grad(ref, leaves, dout)
    res["sdpa_cudnn fwd+bwd ms"] = round(timed(lambda: torch.autograd.grad(
        sdpa_cudnn(*leaves), leaves, dout)), 3)
    backend = AttentionBackend(EngineOptions())
    meta = AttentionMeta.build((B, T), DEV, None, None, T, {None})
    out, state = backend.forward(q, k, v, meta, None, scale)
    res["backend"] = type(state).__name__
    res["out max err"] = float((out.float() - ref.detach().float()).abs().max())
    grads = backend.backward(dout, q, k, v, out, state, meta, None, scale)
    for name, g, r in zip("qkv", grads, ref_g):
        res[f"d{name} rel err"] = float((g.float() - r.float()).norm() / r.float().norm())
    res["aten fwd ms"] = round(timed(lambda: backend.forward(q, k, v, meta, None, scale)), 3)
    res["aten bwd ms"] = round(timed(lambda: backend.backward(dout, q, k, v, out, state, meta,
                                                              None, scale)), 3)
    record("cudnn_ops", **res)


def gemms(M=8192, H=4096, inter=14336, chunk=2304):
    res = {}
    for name, (n, k) in {"q/o": (H, H), "gate+up": (2 * inter, H), "gate": (inter, H),
                         "down": (H, inter)}.items():
        for m in (M, 4096, chunk):
            x = torch.randn(m, k, device=DEV, dtype=BF)
            w = torch.randn(n, k, device=DEV, dtype=BF)
            r = torch.randn(m, n, device=DEV, dtype=BF)
            o = torch.empty(m, n, device=DEV, dtype=BF)
            fl = 2 * m * n * k / 1e9
            res[f"{name} M={m} mm"] = round(fl / timed(lambda: torch.mm(x, w.t(), out=o)), 1)
            res[f"{name} M={m} addmm"] = round(fl / timed(lambda: torch.addmm(r, x, w.t(),
                                                                              out=o)), 1)
            dy = torch.randn(m, n, device=DEV, dtype=BF)
            dx = torch.empty(m, k, device=DEV, dtype=BF)
            res[f"{name} M={m} dX mm"] = round(fl / timed(lambda: torch.mm(dy, w, out=dx)), 1)
            res[f"{name} M={m} dX addmm_"] = round(fl / timed(lambda: dx.addmm_(dy, w)), 1)
            del x, w, r, o, dy, dx
    record("gemm_tflops_variants", **res)


def packed_widths(M=8192, H=4096, inter=14336):
    """TFLOP/s of the packed GEMMs [M, K] @ [N, K]^T for K = in (no LoRA columns), in + R
    unpadded, and padded to 64 / 128 / 256 columns (PACK_ALIGN): cuBLAS picks its kernel by
    shape, and the 8B gate/up GEMM ran ~680 TFLOP/s at K = 4160 in the training step against
    ~815 measured here at K = 4096."""
    res = {}
    for name, n, k, r in (("qkv", 6144, H, 48), ("gate+up", 2 * inter, H, 32),
                          ("down", H, inter, 16)):
        widths = {"K=in": k, "+R": k + r}
        for align in (64, 128, 256):
            widths[f"pad{align}"] = k + r + (-(k + r) % align)
        for label, kk in widths.items():
            x = torch.randn(M, kk, device=DEV, dtype=BF)
            w = torch.randn(n, kk, device=DEV, dtype=BF)
            out = torch.empty(M, n, device=DEV, dtype=BF)
            res[f"{name} {label} (K={kk})"] = round(
                2 * M * n * k / 1e9 / timed(lambda: torch.mm(x, w.t(), out=out)), 1)
            del x, w, out
    record("packed_gemm_tflops", note="useful FLOPs (K = in) per second", **res)


def sustained(M=8192, H=4096, inter=14336, seconds=3.0):
    """The 8B gate/up GEMM in a short burst (20 calls) and held for `seconds`: the training
    step keeps the GPU at full load, and a clock or power limit would show here as a lower
    held rate than the burst's (run with nvidia-smi sampling the SM clock beside it)."""
    res = {}
    for kk in (H, H + 64):
        x = torch.randn(M, kk, device=DEV, dtype=BF)
        w = torch.randn(2 * inter, kk, device=DEV, dtype=BF)
        out = torch.empty(M, 2 * inter, device=DEV, dtype=BF)
        fl = 2 * M * 2 * inter * kk / 1e9
        burst = timed(lambda: torch.mm(x, w.t(), out=out))
        n = max(20, int(seconds * 1e3 / burst))
        held = timed(lambda: torch.mm(x, w.t(), out=out), n=n)
        res[f"K={kk} burst TFLOP/s"] = round(fl / burst, 1)
        res[f"K={kk} held {n} calls TFLOP/s"] = round(fl / held, 1)
        del x, w, out
    record("sustained_gemm", note="all FLOPs of the product (K as given)", **res)


def lora_products(M=8192, H=4096, inter=14336, r=16):
    """The rank-r side products of one layer's backward; GB/s of the big operand read."""
    res = {}
    for name, n, k in (("qkv", 6144, H), ("o", H, H), ("gate", inter, H), ("down", H, inter)):
        dy = torch.randn(M, n, device=DEV, dtype=BF)
        x = torch.randn(M, k, device=DEV, dtype=BF)
        b = torch.randn(n, r, device=DEV, dtype=BF)
        xa = torch.randn(M, r, device=DEV, dtype=BF)
        ga = torch.randn(M, r, device=DEV, dtype=BF)
        a = torch.randn(r, k, device=DEV, dtype=BF)
        for what, fn, nbytes in (("ga=dy@B", lambda: dy @ b, dy.nbytes),
                                 ("dB=dy^T@xa", lambda: dy.t() @ xa, dy.nbytes),
                                 ("dA=ga^T@x", lambda: ga.t() @ x, x.nbytes),
                                 ("xa=x@A^T", lambda: x @ a.t(), x.nbytes)):
            ms = timed(fn)
            res[f"{name} {what} ms"] = round(ms, 4)
            res[f"{name} {what} GB/s"] = round(nbytes / ms / 1e6, 0)
        del dy, x
    record("lora_products", **res)


def copies(mib=256):
    n = mib * 2**20 // 2
    h1 = torch.empty(n, dtype=BF, pin_memory=True)
    h2 = torch.empty(n, dtype=BF, pin_memory=True)
    d1 = torch.empty(n, dtype=BF, device=DEV)
    d2 = torch.empty(n, dtype=BF, device=DEV)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def both():
        with torch.cuda.stream(s1):
            h1.copy_(d1, non_blocking=True)
        with torch.cuda.stream(s2):
            d2.copy_(h2, non_blocking=True)
        torch.cuda.current_stream().wait_stream(s1)
        torch.cuda.current_stream().wait_stream(s2)

    res = {"d2h GB/s": round(n * 2 / timed(lambda: h1.copy_(d1, non_blocking=True), 5) / 1e6, 1),
           "h2d GB/s": round(n * 2 / timed(lambda: d2.copy_(h2, non_blocking=True), 5) / 1e6, 1),
           "both at once, each GB/s": round(n * 2 / timed(both, 5) / 1e6, 1)}
    record("copies", mib=mib, **res)


def triton_ops(M=8192, H=4096, inter=14336, chunk=2304):
    from leantune.kernels.rmsnorm import rms_norm_bwd, rms_norm_fwd
    from leantune.kernels.swiglu import ACTS, glu_bwd_, glu_fwd

    res = {}
    g = torch.randn(chunk, inter, device=DEV, dtype=BF)
    u = torch.randn_like(g)
    da = torch.randn_like(g)
    res["glu_fwd chunk ms"] = round(timed(lambda: glu_fwd(g, u, ACTS["silu"])), 4)
    g2, u2 = g.clone(), u.clone()

    def bwd():
        g2.copy_(g)
        u2.copy_(u)
        glu_bwd_(da, g2, u2, ACTS["silu"])
    copy_ms = timed(lambda: (g2.copy_(g), u2.copy_(u)))
    res["glu_bwd_ chunk ms"] = round(timed(bwd) - copy_ms, 4)
    x = torch.randn(M, H, device=DEV, dtype=BF)
    w = torch.randn(H, device=DEV, dtype=BF)
    y, rstd = rms_norm_fwd(x, w, 1e-5, 0.0)
    dy = torch.randn_like(x)
    res["rms_fwd ms"] = round(timed(lambda: rms_norm_fwd(x, w, 1e-5, 0.0)), 4)
    res["rms_bwd ms"] = round(timed(lambda: rms_norm_bwd(dy, x, w, rstd, 0.0)), 4)
    record("triton_ops", **res)


PARTS = {"cudnn": "cudnn_ops", "packed": "packed_widths",
         "sustained": "sustained", "gemms": "gemms",
         "lora": "lora_products", "copies": "copies", "triton": "triton_ops"}


def main():
    import argparse

    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("parts", nargs="*", metavar="PART", default=list(PARTS),
                    help=f"which measurements, of {list(PARTS)} (default: all)")
    args = ap.parse_args()
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}; choose from {list(PARTS)}")
    for fn in (globals()[PARTS[p]] for p in args.parts):
        try:
            fn()
        except Exception as ex:  # keep going: each part is independent
            record(fn.__name__, error=f"{type(ex).__name__}: {str(ex)[:300]}")
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
