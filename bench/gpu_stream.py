"""Streamed base weights on the GPU (engine/weight_stream.py): the same training passes with some
layers' weights streamed from pinned host memory and with none, compared bit for bit (the copies
run on a side stream: a missing wait would show here, not on the CPU), and the copy overlap
measured: the step's time with every other layer streamed against none, at a plan that keeps
everything (so the difference is the copies' cost alone).

    python bench/gpu_stream.py [--shape llama-3.2-1b] [--steps 3]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import cuda_time, leantune_model, record  # noqa: E402
from speed import random_batch  # noqa: E402

from leantune.engine import Engine, EngineOptions, LayerPlan  # noqa: E402
from leantune.lora import LoRAConfig, apply_lora  # noqa: E402


def model_and_engine(shape, device, plans_of, every_other: bool):
    model = leantune_model(shape, device)
    apply_lora(model, LoRAConfig(r=16, alpha=16), seed=0, dtype=torch.float32)
    with torch.no_grad():  # B random, so every LoRA gradient carries signal
        g = torch.Generator(device=device).manual_seed(1)
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.01, generator=g)
    engine = Engine(EngineOptions())
    engine.pack(model)
    L = len(model.layers)
    engine.attach(model, plans_of(L))
    engine.stream_weights(model, list(range(1, L, 2)) if every_other else [])
    torch.cuda.empty_cache()
    return model, engine


def passes(model, batch, steps, lr=1e-3):
    params = [p for p in model.parameters() if p.requires_grad]
    out = []
    for _ in range(steps):
        loss = model(batch=batch, loss_only=True).loss_sum
        loss.backward()
        out.append((loss.detach().clone(), [p.grad.detach().clone() for p in params]))
        with torch.no_grad():
            for p in params:
                p.sub_(lr * p.grad)
                p.grad = None
    return out


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--control", action="store_true",
                    help="the second run streams nothing either (the comparison's own spread)")
    args = ap.parse_args()
    device = torch.device("cuda")
    from leantune.model.config import ModelConfig
    from harness import hf_config

    vocab = ModelConfig.from_dict(hf_config(args.shape).to_dict()).vocab_size
    batch = random_batch(vocab, args.rows, args.seq).to(device)

    def mixed(L):  # every keep level, offloaded and not
        kinds = [LayerPlan(1, offload=True), LayerPlan(0), LayerPlan(2), LayerPlan(1),
                 LayerPlan(2, offload=True)]
        return [kinds[i % len(kinds)] for i in range(L - 1)] + [LayerPlan(2)]

    rows = []
    for name, plans_of in (("mixed plan", mixed), ("keep all", lambda L: [LayerPlan(2)] * L)):
        results = {}
        for label in ("none", "every other"):
            stream_it = label != "none" and not args.control
            model, engine = model_and_engine(args.shape, device, plans_of, stream_it)
            streamed = engine.stream.layers if engine.stream else []
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            got = passes(model, batch, args.steps)
            times = cuda_time(lambda: passes(model, batch, 1), 2, 5)
            peak = torch.cuda.max_memory_allocated() / 2**30
            results[label] = got
            copies = engine.stream.copies if engine.stream else 0
            ms = 1e3 * sorted(times)[len(times) // 2]
            rows.append((name, label, len(streamed), ms, peak, copies))
            record("stream", shape=args.shape, plan=name, streamed=len(streamed),
                   step_ms=round(ms, 2), peak_gib=round(peak, 3), copies=copies)
            del model, engine
            torch.cuda.empty_cache()
        a, b = results["none"], results["every other"]
        same = all(torch.equal(x[0], y[0]) and all(torch.equal(g, h) for g, h in zip(x[1], y[1]))
                   for x, y in zip(a, b))
        worst = max(max(((g.float() - h.float()).abs().max() / h.float().abs().max()).item()
                        for g, h in zip(x[1], y[1])) for x, y in zip(a, b))
        record("stream_equal", shape=args.shape, plan=name, bit_identical=same,
               max_grad_diff=worst)
        rows.append((name, "bit-identical" if same else f"DIFFERS: max |diff| / max |grad| {worst:.3e}", None, None,
                     None, None))
    print(f"\n{args.shape}, {args.rows} x {args.seq} tokens, LoRA r16 (fwd+bwd+SGD, median ms)")
    print(f"{'plan':<11} {'streamed':<14} {'layers':>6} {'ms':>8} {'peak GiB':>9} {'copies':>7}")
    for name, label, n, ms, peak, copies in rows:
        if n is None:
            print(f"{name:<11} {label}")
        else:
            print(f"{name:<11} {label:<14} {n:>6} {ms:>8.1f} {peak:>9.2f} {copies:>7}")


if __name__ == "__main__":
    main()
