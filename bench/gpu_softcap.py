"""GPU check of Gemma 2's soft-capped attention: the Triton kernels (kernels/softcap_attention.py)
against the PyTorch query blocks they replace (model/softcap_attention.py), at the Gemma-2-9B
attention shape (Hq 16, Hk 8, D 256, softcap 50, 4 rows x 2048 tokens, bf16), windows 4096 (the
global layers: all of a 2048-token row) and 1024 (a narrower variant), one document a row and
packed documents. Forward and forward+backward: median time, the kernel's TFLOP/s (4 flops per
visible (query, key) pair and head-dim element forward, 10 backward) and the max abs error of
out, dq, dk, dv against the query blocks (both from the same bf16 inputs; the blocks compute in
fp32), then a short table; one JSON line per case (bench/harness.record).

    python bench/gpu_softcap.py               # the CUDA check (about a minute)
    python bench/gpu_softcap.py --sweep       # also time other kernel block sizes
    python bench/gpu_softcap.py --tiny        # tiny shapes on the CPU (Triton interpreter, fp32)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def parse_args(argv=None):
    ap = argparse.ArgumentParser(allow_abbrev=False,
                                 description="soft-capped attention: Triton vs query blocks")
    ap.add_argument("--tiny", action="store_true",
                    help="tiny shapes on the CPU through the Triton interpreter")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=256)
    ap.add_argument("--softcap", type=float, default=50.0)
    ap.add_argument("--windows", type=int, nargs="+", help="default: 4096 1024 (--tiny: 4096 9)")
    ap.add_argument("--layouts", nargs="+", default=["rows", "packed"], choices=["rows", "packed"],
                    help="rows: one document a row; packed: documents of 100-1500 tokens")
    ap.add_argument("--sweep", action="store_true",
                    help="time other block sizes too (LEANTUNE_SOFTCAP_FWD / _DKDV / _DQ)")
    args = ap.parse_args(argv)
    if args.tiny:  # odd sizes: partial blocks, GQA, windows shorter than a document
        args.rows, args.seq, args.heads, args.kv_heads, args.head_dim = 2, 37, 4, 2, 32
    args.windows = args.windows or ([4096, 9] if args.tiny else [4096, 1024])
    return args


ARGS = parse_args()
if ARGS.tiny:  # triton.jit reads this when the kernel modules are imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import record  # noqa: E402

from leantune import kernels  # noqa: E402
from leantune.kernels import softcap_attention as kernel  # noqa: E402
from leantune.model.attention import AttentionMeta  # noqa: E402
from leantune.model.softcap_attention import (_doc_bounds, softcap_attention_backward,  # noqa
                                              softcap_attention_forward)

# "BLOCK_M,BLOCK_N,num_warps,num_stages,split" (queries, keys) tried by --sweep for each kernel
# (LEANTUNE_SOFTCAP_FWD / _DKDV / _DQ), beside the defaults (kernels/softcap_attention.py)
SWEEP = {"LEANTUNE_SOFTCAP_FWD": ["64,64,8,2,0", "128,64,8,2,1", "128,32,8,2,1", "64,32,8,2,1",
                                  "64,64,8,3,1", "64,64,4,2,1"],
         "LEANTUNE_SOFTCAP_DKDV": ["64,32,8,2,1", "32,32,8,2,0", "32,32,8,1,1", "32,64,8,2,0",
                                   "64,32,8,1,0", "16,64,8,2,0"],
         "LEANTUNE_SOFTCAP_DQ": ["64,32,8,2,0", "64,64,8,2,1", "128,32,8,2,1", "32,32,8,2,1",
                                 "64,32,4,2,1", "64,16,4,2,1"]}
TINY_SWEEP = {"LEANTUNE_SOFTCAP_FWD": ["32,16,1,1,0"], "LEANTUNE_SOFTCAP_DKDV": ["16,32"],
              "LEANTUNE_SOFTCAP_DQ": ["32,16,1,1,0"]}


def doc_lens(rows: int, seq: int, tiny: bool) -> list[int]:
    """Packed documents: lengths drawn in [100, 1500] (tiny: [3, 20]) filling each row, the
    rest of a row one last segment (as the packer's padding)."""
    g = torch.Generator().manual_seed(0)
    lo, hi = (3, 20) if tiny else (100, 1500)
    lens = []
    for _ in range(rows):
        left = seq
        while left > 0:
            n = min(left, int(torch.randint(lo, hi + 1, (1,), generator=g)))
            lens.append(n)
            left -= n
    return lens


def make_case(args, dev, layout: str, window: int):
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    B, T, Hq, Hk, D = args.rows, args.seq, args.heads, args.kv_heads, args.head_dim
    q = torch.randn(B, T, Hq, D, device=dev, generator=g).to(dtype)
    k = torch.randn(B, T, Hk, D, device=dev, generator=g).to(dtype)
    v = torch.randn(B, T, Hk, D, device=dev, generator=g).to(dtype)
    do = torch.randn(B, T, Hq, D, device=dev, generator=g).to(dtype)
    lens = doc_lens(B, T, args.tiny) if layout == "packed" else None
    meta = AttentionMeta.build((B, T), dev, seq_lens=lens, cu_seqlens=None,
                               max_seqlen=max(lens or [T]), windows={window}, dtype=dtype,
                               path="varlen")
    return q, k, v, do, meta


def visible_pairs(meta, B, T, window, dev) -> int:
    """(query, key) pairs attended to, over all rows (one head)."""
    start, _ = _doc_bounds(meta, B, T, dev)
    return int(kernel.visible_keys(start, B, T, window, dev).sum())


def timed_ms(fn, dev) -> float:
    """Median milliseconds: triton.testing.do_bench on CUDA, one wall-clock run elsewhere."""
    if dev.type == "cuda":
        from triton.testing import do_bench
        return do_bench(fn, warmup=3, rep=20, return_mode="median")
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1e3


def run(backend: str, case, window, scale, softcap, dev):
    """-> ((out, dq, dk, dv), fwd ms, fwd+bwd ms) through the model's entry points."""
    q, k, v, do, meta = case

    def fwd():
        return softcap_attention_forward(q, k, v, meta, window, scale, softcap)

    def fwd_bwd():
        out, lse = fwd()
        return (out, *softcap_attention_backward(do, q, k, v, out, lse, meta, window, scale,
                                                 softcap))
    res = []

    def keep_first():
        r = fwd_bwd()
        if not res:
            res.append(r)
    with kernels.backend(backend):
        tot = timed_ms(keep_first, dev)
        return res[0], timed_ms(fwd, dev), tot


def rel_error(got, want) -> float:
    """The largest norm-relative error over pairs of tensors."""
    return max(((a.float() - b.float()).norm() / b.float().norm()).item()
               for a, b in zip(got, want))


def main():
    args = ARGS
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if dev.type != "cuda" and not args.tiny:
        sys.exit("gpu_softcap.py: no CUDA device; run with --tiny for the CPU check")
    B, T, Hq, Hk, D = args.rows, args.seq, args.heads, args.kv_heads, args.head_dim
    scale, cap = D ** -0.5, args.softcap
    tol = 3e-2 if dev.type == "cuda" else 1e-5  # norm-relative: bf16 / fp32
    rows, ok = [], True
    for layout in args.layouts:
        for window in args.windows:
            case = make_case(args, dev, layout, window)
            pairs = visible_pairs(case[4], B, T, window, dev)
            res_k, fwd_k, tot_k = run("triton", case, window, scale, cap, dev)
            res_r, fwd_r, tot_r = run("reference", case, window, scale, cap, dev)
            errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(res_k, res_r)]
            rel = rel_error(res_k, res_r)
            ok = ok and rel < tol
            flops = 4 * pairs * Hq * D
            tflops = (flops / fwd_k * 1e-9, 3.5 * flops / tot_k * 1e-9)
            sweep = {}
            if args.sweep:
                for var, configs in (TINY_SWEEP if args.tiny else SWEEP).items():
                    which = var.split("_")[-1].lower()  # fwd: the fwd time; else fwd+bwd
                    for cfg in configs:
                        os.environ[var] = cfg
                        try:
                            res, t_fwd, t_tot = run("triton", case, window, scale, cap, dev)
                            r = rel_error(res, res_r)
                            sweep[f"{which} {cfg}"] = (f"{t_fwd if which == 'fwd' else t_tot:.2f}"
                                                       f" ms" + ("" if r < tol else " MISMATCH"))
                        except Exception as e:  # e.g. out of shared memory at this block size
                            sweep[f"{which} {cfg}"] = type(e).__name__
                        del os.environ[var]
            rows.append((layout, window, fwd_k, tot_k, fwd_r, tot_r, tflops, errs, rel, sweep))
            if not args.tiny:
                record("softcap_attention", layout=layout, window=window,
                       shape=f"{B}x{T} Hq{Hq} Hk{Hk} D{D}", softcap=cap, kernel_fwd_ms=fwd_k,
                       kernel_fwd_bwd_ms=tot_k, blocks_fwd_ms=fwd_r, blocks_fwd_bwd_ms=tot_r,
                       kernel_tflops_fwd=tflops[0], kernel_tflops_fwd_bwd=tflops[1],
                       max_abs_out_dq_dk_dv=errs, max_rel=rel,
                       sweep=sweep)
    for layout, window, fwd_k, tot_k, *_, sweep in rows:
        if sweep:
            print(f"sweep {layout} w{window} (default: fwd {fwd_k:.2f} ms, fwd+bwd {tot_k:.2f} ms):"
                  + "".join(f"\n  {name}: {t}" for name, t in sweep.items()))
    dtype = "bf16" if dev.type == "cuda" else "fp32"
    print(f"softcap attention  {B} x {T} tokens  Hq {Hq} Hk {Hk} D {D}  softcap {cap}  {dtype} "
          f"({dev.type})")
    print("ms: median; speedup: fwd+bwd of the blocks / the kernel's; TFLOP/s: the kernel's")
    print(f"{'layout':<8}{'window':>7}{'kernel fwd':>12}{'fwd+bwd':>10}{'blocks fwd':>12}"
          f"{'fwd+bwd':>10}{'speedup':>9}{'TFLOP/s':>13}  max|err| out dq dk dv")
    for layout, window, fwd_k, tot_k, fwd_r, tot_r, tflops, errs, rel, _ in rows:
        print(f"{layout:<8}{window:>7}{fwd_k:>12.2f}{tot_k:>10.2f}{fwd_r:>12.2f}{tot_r:>10.2f}"
              f"{tot_r / tot_k:>8.1f}x{tflops[0]:>7.0f} /{tflops[1]:>4.0f}  "
              + " ".join(f"{e:.1e}" for e in errs) + f" (rel {rel:.1e})")
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
