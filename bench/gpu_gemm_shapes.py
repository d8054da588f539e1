"""The projection GEMMs of a step at the shapes the engine runs them, on CUDA (bf16, cuBLAS):

- the residual: down's forward as addmm into another buffer (what PyTorch does: copy the
  residual into the output, then a GEMM with beta = 1), as mm then one add pass (the engine's
  default, EngineOptions.gemm_residual off), and mm alone;
- the packed q/k/v forward with K = hidden + the LoRA columns padded to 64 (the default
  pack_align), to 128, and without LoRA columns (K = hidden).

Optionally under host-link traffic (--link: a side stream copying 256 MiB each way, pinned,
in a loop), as in an offloading step. Prints ms and TFLOP/s per variant; one JSON row each.

    python bench/gpu_gemm_shapes.py [--tokens 6144 8192] [--shape llama-3.1-8b] [--link]
"""

from __future__ import annotations

import argparse
import json
import os
import threading
import time

import torch

from harness import hf_config, mean_ms


def _time(fn) -> float:
    """Mean ms of fn (harness.mean_ms); on the CPU (--device cpu, a dry run) two timed calls."""
    if torch.cuda.is_available():
        return mean_ms(fn)
    fn()
    t0 = time.perf_counter()
    fn(), fn()
    return (time.perf_counter() - t0) / 2 * 1e3


class _Link:
    """Host-link traffic on side streams while the GEMMs run (both directions)."""

    def __init__(self, mib=256):
        n = mib * 2**20 // 2
        self.host = [torch.empty(n, dtype=torch.bfloat16).pin_memory() for _ in range(2)]
        self.dev = [torch.empty(n, dtype=torch.bfloat16, device="cuda") for _ in range(2)]
        self.streams = [torch.cuda.Stream(), torch.cuda.Stream()]
        self.stop = threading.Event()

    def _loop(self):
        while not self.stop.is_set():
            with torch.cuda.stream(self.streams[0]):
                self.host[0].copy_(self.dev[0], non_blocking=True)
            with torch.cuda.stream(self.streams[1]):
                self.dev[1].copy_(self.host[1], non_blocking=True)
            self.streams[0].synchronize()
            self.streams[1].synchronize()

    def __enter__(self):
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *a):
        self.stop.set()
        self.thread.join()


def _pad(n: int, to: int) -> int:
    return n + (-n % to)


def run(shape: str, tokens: int, link: bool, device: str = "cuda") -> list[dict]:
    c = hf_config(shape)
    h, i = c.hidden_size, c.intermediate_size
    heads, kv = c.num_attention_heads, c.num_key_value_heads
    hd = getattr(c, "head_dim", None) or h // heads
    qkv_out = (heads + 2 * kv) * hd
    r = 16
    bf = dict(dtype=torch.bfloat16, device=device)
    rows = []

    def row(name, m, k, n, ms):
        d = dict(section="gemm_variant", shape=shape, tokens=tokens, link=link, variant=name,
                 m=m, k=k, n=n, ms=round(ms, 4), tflops=round(2 * m * k * n / ms / 1e9, 1))
        rows.append(d)
        print(f"{shape:13s} {tokens:6d} {'link' if link else '    '}  {name:34s} "
              f"[{m} x {k}] @ [{k} x {n}]  {ms:7.3f} ms  {d['tflops']:6.1f} TFLOP/s", flush=True)

    # down: [tokens, I + LoRA cols] @ [.., hidden], residual [tokens, hidden]
    k = _pad(i + r, 64)  # (the LoRA columns padded to pack_align 64)
    x = torch.randn(tokens, k, **bf)
    w = torch.randn(h, k, **bf) / k ** 0.5
    resid = torch.randn(tokens, h, **bf)
    out = torch.empty(tokens, h, **bf)
    row("down addmm (resid copied into out)", tokens, k, h,
        _time(lambda: torch.addmm(resid, x, w.t(), out=out)))
    row("down mm + add", tokens, k, h,
        _time(lambda: torch.mm(x, w.t(), out=out).add_(resid)))
    row("down mm", tokens, k, h, _time(lambda: torch.mm(x, w.t(), out=out)))
    del x, w
    # q/k/v packed: K = hidden + LoRA columns (3 x r) padded
    for name, kk in (("qkv K = hidden", h), ("qkv K padded to 64", _pad(h + 3 * r, 64)),
                     ("qkv K padded to 128", _pad(h + 3 * r, 128))):
        x = torch.randn(tokens, kk, **bf)
        w = torch.randn(qkv_out, kk, **bf) / kk ** 0.5
        o = torch.empty(tokens, qkv_out, **bf)
        row(name, tokens, kk, qkv_out, _time(lambda: torch.mm(x, w.t(), out=o)))
        del x, w, o
    return rows


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--shape", nargs="+", default=["llama-3.1-8b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[6144, 8192])
    ap.add_argument("--link", action="store_true", help="also under host-link traffic")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run (small, timings void)")
    args = ap.parse_args()
    out = os.environ.get("OUT", "bench-out")
    os.makedirs(out, exist_ok=True)
    rows = []
    for shape in args.shape:
        for tokens in args.tokens:
            rows += run(shape, tokens, False, args.device)
            if args.link and args.device == "cuda":
                with _Link():
                    rows += run(shape, tokens, True)
    with open(os.path.join(out, "results.jsonl"), "a") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


if __name__ == "__main__":
    main()
