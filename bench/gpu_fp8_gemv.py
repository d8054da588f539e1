"""Issue 23, decoding: the weight-only FP8 GEMV (kernels/fp8_gemv.py) against the FP8 GEMM
(kernels/fp8_gemm.py, which fp8_mm used for every row count before) and bf16 torch.matmul, at
--rows (1: batch-1 decoding) against the Llama-3.1-8B projections, the packed qkv / gate-up
included. Microseconds a call and GB/s of weight bytes (e4m3: 1 a weight plus the block scales;
bf16: 2), each timed as a CUDA graph of calls cycling over copies of the weight (cold L2, no
host launch cost: what a captured decode step pays); the GEMV's tuned config; its error
against x @ dequantize(W)^T (fp32), eager and replayed from a CUDA graph on a new x, and the
GEMM's (which also rounds x to e4m3). Last, the
projections of one token through 32 layers for each kernel: unpacked (q, k, v, o, gate, up,
down: LEANTUNE_FP8_PACKED_DECODE=0) and packed (qkv, o, gate_up, down: the FP8 decode path),
and the LM head (128256 rows: the FP8 decode head against the 16-bit one).

    python bench/gpu_fp8_gemv.py                 # the GPU (~1 min on an H200, first tuning incl.)
    python bench/gpu_fp8_gemv.py --rows 1 4 16   # also a few-row batch (GRPO rollouts)
    python bench/gpu_fp8_gemv.py --tiny          # the same code on the CPU (interpreter), seconds
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from harness import record  # noqa: E402

from leantune.kernels import fp8_gemm as gemm  # noqa: E402
from leantune.kernels import fp8_gemv as gemv  # noqa: E402
from leantune.kernels.fp8 import FP8View, FP8Weight  # noqa: E402

# Llama-3.1-8B's projections (out, in); "qkv" and "gate_up": the engine's packed groups
SHAPES = {"q/o": (4096, 4096), "k/v": (1024, 4096), "qkv": (6144, 4096),
          "gate/up": (14336, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}  # (the FP8 decode head: generate/projections._FP8Head)
TINY_SHAPES = {"q/o": (256, 200), "k/v": (130, 200), "qkv": (512, 200), "gate/up": (384, 200),
               "gate_up": (768, 200), "down": (200, 384), "lm_head": (300, 200)}
# per token and layer, as the decode path (LoRALinear, one GEMM a projection) runs them
PER_LAYER = {"q/o": 2, "k/v": 2, "gate/up": 2, "down": 1}
# as the packed FP8 decode path runs them (generate/projections._PackedFP8): one GEMV a group
PACKED_PER_LAYER = {"qkv": 1, "q/o": 1, "gate_up": 1, "down": 1}
LAYERS = 32


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref).norm() / ref.norm()).item()


def measure(name: str, N: int, K: int, M: int, device, dtype) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.empty(N, K, device=device, dtype=dtype).normal_(0, 0.02, generator=g)
    x = torch.empty(M, K, device=device, dtype=dtype).normal_(0, 1, generator=g)
    q = FP8Weight((N, K), dtype, device=device).quantize_(w)
    exact = x.float() @ q.dequantize(dtype=torch.float32).t()
    out = torch.empty(M, N, device=device, dtype=dtype)
    fp8_bytes = q.nbytes + (x.numel() + out.numel()) * x.element_size()
    bf16_bytes = (w.numel() + x.numel() + out.numel()) * x.element_size()
    row = dict(shape=name, M=M, N=N, K=K)
    cfg = gemv.config_for(x, q, out, None)  # (tunes on the GPU, first use)
    row.update(gemv_config=cfg._asdict(),
               gemv_err=rel_err(gemv.fp8_gemv(x, q, config=cfg), exact),
               gemm_err=rel_err(gemm.fp8_gemm(x, q), exact))
    if device.type == "cuda":  # captured once, replayed on new input: the decode step's use
        xs, got = x.clone(), torch.empty_like(out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemv.fp8_gemv(xs, q, out=got)  # (the tuned config, found in the capture)
        xs.normal_(0, 1, generator=g)
        graph.replay()
        row["gemv_graph_err"] = rel_err(got, xs.float() @ q.dequantize(dtype=torch.float32).t())
        del graph
    views = [FP8View(d, q.scale, q.dtype) for d in gemv.rotating_copies(q.data)]
    kinds = {
        "gemv": ([lambda v=v: gemv.fp8_gemv(x, v, out=out, config=cfg) for v in views],
                 fp8_bytes),
        "gemm": ([lambda v=v: gemm.fp8_gemm(x, v, out=out) for v in views], fp8_bytes),
        "bf16": ([lambda c=c: torch.matmul(x, c.t(), out=out) for c in gemv.rotating_copies(w)],
                 bf16_bytes),
    }
    for kind, (calls, nbytes) in kinds.items():
        try:
            us = gemv.graph_time_us(calls, device)
            row.update({f"{kind}_us": us, f"{kind}_gbs": nbytes / us / 1e3})
        except Exception as e:  # one kernel failing leaves the others' numbers
            row[f"{kind}_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        del calls
    record("fp8_gemv", **row)
    return row


def _f(v, fmt="{:.1f}"):
    return "-" if v is None else fmt.format(v)


def print_table(rows: list[dict]) -> None:
    print("\nGEMV  shape    M x N x K            us: gemv / fp8_gemm / bf16   "
          "GB/s: gemv / fp8_gemm / bf16   rel err gemv / graph / gemm   gemv config")
    for r in rows:
        c = r["gemv_config"]
        print(f"      {r['shape']:<8} {r['M']}x{r['N']}x{r['K']:<12} "
              f"{_f(r.get('gemv_us')):>7} / {_f(r.get('gemm_us')):>7} / {_f(r.get('bf16_us')):>7}"
              f"   {_f(r.get('gemv_gbs'), '{:.0f}'):>6} / {_f(r.get('gemm_gbs'), '{:.0f}'):>6} / "
              f"{_f(r.get('bf16_gbs'), '{:.0f}'):>6}   {r['gemv_err']:.1e} / "
              f"{_f(r.get('gemv_graph_err'), '{:.1e}')} / {r['gemm_err']:.1e}"
              f"   {c['loop']} n{c['block_n']} k{c['block_k']} split{c['split_k']} "
              f"w{c['num_warps']} s{c['num_stages']}")
    for M in sorted({r["M"] for r in rows}):
        by = {r["shape"]: r for r in rows if r["M"] == M}
        for label, per_layer in (("unpacked", PER_LAYER), ("packed", PACKED_PER_LAYER)):
            if not all(s in by for s in per_layer):
                continue
            totals = {k: LAYERS * sum(n * (by[s].get(f"{k}_us") or float("nan"))
                                      for s, n in per_layer.items())
                      for k in ("gemv", "gemm", "bf16")}
            head = (f"; + lm_head gemv {by['lm_head']['gemv_us'] / 1e3:.3f} ms / bf16 "
                    f"{by['lm_head']['bf16_us'] / 1e3:.3f} ms"
                    if "gemv_us" in by.get("lm_head", {}) and "bf16_us" in by["lm_head"] else "")
            print(f"GEMV  projections of one token ({label}), {LAYERS} layers, M={M}: gemv "
                  f"{totals['gemv'] / 1e3:.2f} ms / fp8_gemm {totals['gemm'] / 1e3:.2f} ms / "
                  f"bf16 {totals['bf16'] / 1e3:.2f} ms{head}")


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1], help="x rows M (<= 16)")
    ap.add_argument("--shapes", nargs="+", default=None, help=f"of {sorted(SHAPES)}")
    ap.add_argument("--tiny", action="store_true", help="CPU, tiny shapes, the interpreter")
    ap.add_argument("--device", default=None)
    args = ap.parse_args()
    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args.shapes:
        shapes = {k: shapes[k] for k in args.shapes}
    rows = [measure(name, N, K, M, device, torch.bfloat16)
            for M in args.rows for name, (N, K) in shapes.items()]
    print_table(rows)


if __name__ == "__main__":
    main()
