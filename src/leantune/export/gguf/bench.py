"""Quantiser speed at the Llama-3.1-8B shape, on the CPU: random weights (std 0.02) of every
tensor shape, made and quantised one at a time as the export streams them, with the types
`--quant` gives each; prints seconds per type and in all.

    python -m leantune.export.gguf.bench --quant q4_k_m [--threads N]

Measured on this project's 2-core CPU host (torch 2.13, 2 threads, another process on the
cores part of the time), 2026-12-01:
- q4_k_m: 155 s quantising (6.50B parameters in q4_k at 47 M/s, 1.53B in q6_k at 88 M/s);
  201 s with making the random weights
- q6_k: 85 s quantising (8.03B parameters at 95 M/s); 129 s with making the weights
A real export adds reading (and merging) the weights and writing the file.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from .quants import quantize
from .tensors import tensor_type

# Llama-3.1-8B: hidden 4096, 32 layers, 32 heads / 8 kv heads of 128, MLP 14336, vocab 128256
HIDDEN, LAYERS, KV, MLP, VOCAB = 4096, 32, 1024, 14336, 128256


def shapes():
    yield "token_embd.weight", (VOCAB, HIDDEN)
    for i in range(LAYERS):
        for name, shape in [("attn_q", (HIDDEN, HIDDEN)), ("attn_k", (KV, HIDDEN)),
                            ("attn_v", (KV, HIDDEN)), ("attn_output", (HIDDEN, HIDDEN)),
                            ("ffn_gate", (MLP, HIDDEN)), ("ffn_up", (MLP, HIDDEN)),
                            ("ffn_down", (HIDDEN, MLP))]:
            yield f"blk.{i}.{name}.weight", shape
    yield "output.weight", (VOCAB, HIDDEN)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--quant", default="q4_k_m")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    seconds, params = defaultdict(float), defaultdict(int)
    g = torch.Generator().manual_seed(0)
    start = time.perf_counter()
    for name, shape in shapes():
        qtype = tensor_type(name, shape, args.quant, LAYERS, tied=False)
        w = torch.randn(shape, generator=g).mul_(0.02)
        t = time.perf_counter()
        quantize(w, qtype)
        seconds[qtype.name] += time.perf_counter() - t
        params[qtype.name] += w.numel()
    total = time.perf_counter() - start
    for name in seconds:
        print(f"{name}: {params[name] / 1e9:.2f}B parameters in {seconds[name]:.0f} s "
              f"({params[name] / seconds[name] / 1e6:.0f} M/s)")
    print(f"{args.quant}, 8B shape, {args.threads} threads: {sum(seconds.values()):.0f} s "
          f"quantising, {total:.0f} s with making the random weights")


if __name__ == "__main__":
    main()
