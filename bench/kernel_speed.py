"""Per-kernel benchmark on the GPU: each Triton op vs its plain-PyTorch (eager) reference,
forward+backward time (median, triton.testing.do_bench) and peak memory, at Llama-3.1-8B sizes
(8192 tokens). Also checks, on the GPU, that each kernel matches its reference.

    python bench/kernel_speed.py

(Not named kernels.py: run as a script, bench/ comes first on sys.path, and a module named
`kernels` there hides the hub `kernels` package that transformers >= 5.25 imports.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import record  # noqa: E402

from leantune import kernels  # noqa: E402

N, H, I, V = 8192, 4096, 14336, 128256
B, T, HQ, HK, D = 4, 2048, 32, 8, 128


def cases():
    dev, bf = "cuda", torch.bfloat16

    def rms():
        x = torch.randn(N, H, device=dev, dtype=bf, requires_grad=True)
        w = torch.randn(H, device=dev, dtype=bf)  # frozen (LoRA): no weight grad
        return (lambda: kernels.rms_norm(x, w, 1e-5)), [x]

    def rope():
        q = torch.randn(B, T, HQ, D, device=dev, dtype=bf, requires_grad=True)
        k = torch.randn(B, T, HK, D, device=dev, dtype=bf, requires_grad=True)
        pos = torch.arange(T, device=dev).expand(B, T)
        inv = 1.0 / (500000 ** (torch.arange(0, D, 2, device=dev).float() / D))
        emb = torch.cat([pos[..., None] * inv] * 2, -1)
        cos, sin = emb.cos().to(bf), emb.sin().to(bf)

        def f():
            # the projections' outputs are fresh tensors in the model; clone models that
            qq, kk = kernels.apply_rope(q * 1, k * 1, cos, sin)
            return qq.float().sum() + kk.float().sum()
        return f, [q, k]

    def glu():
        g = torch.randn(N, I, device=dev, dtype=bf, requires_grad=True)
        u = torch.randn(N, I, device=dev, dtype=bf, requires_grad=True)
        return (lambda: kernels.swiglu(g * 1, u * 1)), [g, u]

    def flce():
        h = torch.randn(N, H, device=dev, dtype=bf, requires_grad=True)
        w = torch.randn(V, H, device=dev, dtype=bf) * 0.02
        y = torch.randint(0, V, (N,), device=dev)
        y[::7] = -100
        return (lambda: kernels.fused_linear_cross_entropy(h, w, y)), [h]

    return {"rmsnorm": rms, "rope": rope, "swiglu": glu, "fused_linear_ce": flce}


def run_case(make, backend):
    from triton.testing import do_bench

    with kernels.backend(backend):
        fn, inputs = make()

        def fwd_bwd():
            out = fn()
            loss = out if out.dim() == 0 else out.float().sum()
            grads = torch.autograd.grad(loss, inputs)
            return out, grads

        out, grads = fwd_bwd()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fwd_bwd()
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**30
        fwd_ms = do_bench(lambda: fn(), warmup=25, rep=100, return_mode="median")
        total_ms = do_bench(fwd_bwd, warmup=25, rep=100, return_mode="median")
        return out.detach().float(), [g.float() for g in grads], fwd_ms, total_ms, peak


def main():
    torch.manual_seed(0)
    for name, make in cases().items():
        torch.manual_seed(0)
        out_t, g_t, fwd_t, tot_t, peak_t = run_case(make, "triton")
        torch.manual_seed(0)
        out_r, g_r, fwd_r, tot_r, peak_r = run_case(make, "reference")
        rel = max([((out_t - out_r).norm() / out_r.norm().clamp_min(1e-12)).item()] +
                  [((a - b).norm() / b.norm().clamp_min(1e-12)).item() for a, b in zip(g_t, g_r)])
        record("kernel", kernel=name, triton_fwd_ms=fwd_t, eager_fwd_ms=fwd_r,
               triton_fwd_bwd_ms=tot_t, eager_fwd_bwd_ms=tot_r, speedup=tot_r / tot_t,
               triton_extra_peak_gib=peak_t, eager_extra_peak_gib=peak_r, max_rel_err=rel)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
