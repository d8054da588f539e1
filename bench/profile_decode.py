"""Where a batch-1 decode step's time goes: its kernels by name (GPU us per token, calls per
token), the sum of kernel time against the wall time per token, and so the share lost between
kernels (launch latency inside the CUDA graph, host work between steps).

    python bench/profile_decode.py                      # Llama-3.1-8B shape, FP8 weights
    python bench/profile_decode.py --precision bf16
    python bench/profile_decode.py --tiny               # the same code path on the CPU

The model is bench/harness.leantune_model (random weights, LoRA r16 on every projection), as
bench/gpu_fp8.py's decode part; a 128-token prompt, --new-tokens greedy tokens (EOS off), CUDA
graphs on. One warm-up call tunes the GEMVs and captures the graph; one profiled call follows.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import leantune_model, record  # noqa: E402
from shapes import SHAPES  # noqa: E402

import leantune  # noqa: E402


def kernel_table(prof, tokens: int, top: int) -> tuple[float, int, dict]:
    """-> (kernel us per token, kernels per token, {name: (us per token, calls per token)})."""
    by_name, calls = defaultdict(float), defaultdict(int)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            name = ev.name[:80]
            by_name[name] += ev.time_range.elapsed_us()
            calls[name] += 1
    total = sum(by_name.values()) / tokens
    count = sum(calls.values()) // max(tokens, 1)
    rows = {n: (us / tokens, calls[n] / tokens)
            for n, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]}
    return total, count, rows


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--precision", default="fp8", choices=["bf16", "fp8"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--call-tokens", type=int, default=256)
    ap.add_argument("--host-profile", help="write the 1-token call's host profile here")
    ap.add_argument("--eager-ops", action="store_true",
                    help="also an op table of eager decode steps (which op runs which kernel)")
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (checks the path)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    shape = "tiny" if args.tiny else args.shape
    if args.tiny:  # head_dim 32: FP8's 128 x 128 blocks tile the projections
        SHAPES["tiny"] = dict(SHAPES["tiny"], num_key_value_heads=4, head_dim=32,
                              hidden_size=128, num_attention_heads=4, intermediate_size=384)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = leantune_model(shape, device, dtype).eval()
    if args.precision == "fp8":
        from leantune.lora.base_weight import quantize_fp8_
        quantize_fp8_(model)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, model.config.vocab_size, (1, 8 if args.tiny else 128),
                         generator=g).tolist()
    graphs = device.type == "cuda"

    def run(n):
        return leantune.generate(model, None, rows, max_new_tokens=n, eos_token_ids=[],
                                 cuda_graphs=graphs)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    run(args.new_tokens)  # tunes, captures
    # wall per token: a long call minus a short one (prefill and setup cancel out)
    walls = {}
    for n in (8, 8 + args.new_tokens):
        sync()
        t0 = time.perf_counter()
        run(n)
        sync()
        walls[n] = time.perf_counter() - t0
    wall_us = (walls[8 + args.new_tokens] - walls[8]) / args.new_tokens * 1e6
    # what a user's call costs: --call-tokens new tokens (gpu_fp8's decode part: 256) over the
    # call's wall time, and the fixed part of a call (a 1-token call), with its host profile
    call = {}
    for n in (1, args.call_tokens):
        run(n)  # (a graph for this call's cache size)
        ts = []
        for _ in range(3):
            sync()
            t0 = time.perf_counter()
            run(n)
            sync()
            ts.append(time.perf_counter() - t0)
        call[n] = sorted(ts)[1]
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    run(1)
    sync()
    pr.disable()
    buf = io.StringIO()
    pstats.Stats(pr, stream=buf).sort_stats("cumulative").print_stats(45)
    pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
    text = "\n".join(ln for ln in buf.getvalue().splitlines() if ln.strip())
    if args.host_profile:
        Path(args.host_profile).write_text(text)
    else:
        print(text[-3000:])
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if graphs else [])
    with profile(activities=acts) as prof:
        run(args.new_tokens)
        sync()
    if args.eager_ops and graphs:  # which op launches each kernel: eager steps, op table
        with profile(activities=acts) as eprof:
            leantune.generate(model, None, rows, max_new_tokens=args.new_tokens,
                              eos_token_ids=[], cuda_graphs=False)
            sync()
        n = args.new_tokens + 1
        ops = [e for e in eprof.key_averages() if e.self_device_time_total > 0]
        ops.sort(key=lambda e: -e.self_device_time_total)
        print("   eager decode (no graph): ops by their kernels' time")
        for e in ops[:args.top]:
            print(f"   {e.self_device_time_total / n:8.1f} us/token  x{e.count / n:5.1f}  "
                  f"{e.key[:70]}", flush=True)
    kern_us, count, rows_ = kernel_table(prof, args.new_tokens + 1, args.top)
    for name, (us, c) in rows_.items():
        print(f"   {us:8.1f} us/token  x{c:5.1f}  {name}", flush=True)
    row = dict(shape=shape, precision=args.precision, wall_us_per_token=round(wall_us, 1),
               tok_s=round(1e6 / wall_us, 1), kernel_us_per_token=round(kern_us, 1),
               kernels_per_token=count,
               between_kernels_us=round(wall_us - kern_us, 1) if kern_us else None,
               call_tokens=args.call_tokens,
               call_tok_s=round(args.call_tokens / call[args.call_tokens], 1),
               one_token_call_ms=round(call[1] * 1e3, 2))
    record("decode_profile", **row)
    print("\n| shape | precision | tok/s (steady) | wall us/token | kernel us/token | "
          "kernels/token | between kernels us | call tok/s | 1-token call ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(f"| {shape} | {args.precision} | {row['tok_s']} | {row['wall_us_per_token']} | "
          f"{row['kernel_us_per_token']} | {count} | {row['between_kernels_us']} | "
          f"{row['call_tok_s']} | {row['one_token_call_ms']} |")


if __name__ == "__main__":
    main()
