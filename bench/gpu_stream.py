"""Streamed base weights on the GPU (engine/weight_stream.py): one model's training passes with
no layer's weights streamed, again (the comparison's own spread), and with every other layer's
streamed from pinned host memory, each from the same LoRA weights, compared bit for bit (the
copies run on a side stream: a missing wait would show here, not on the CPU); and the step's time
each way, at a mixed plan and at one that keeps everything (there the difference is the copies'
cost alone).

    python bench/gpu_stream.py [--shape llama-3.2-1b] [--steps 3] [--control]
    python bench/gpu_stream.py --device cpu --shape tiny --rows 2 --seq 64   (dry run)
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
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script's code")
    ap.add_argument("--control", action="store_true",
                    help="the third run streams nothing either")
    args = ap.parse_args()
    device = torch.device(args.device)
    cuda = device.type == "cuda"
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
        # one model: its passes unstreamed, again unstreamed (the comparison's own spread: the
        # attention backward may not be deterministic), then streamed, each from the same LoRA
        # weights
        model, engine = model_and_engine(args.shape, device, plans_of, False)
        params = [p for p in model.parameters() if p.requires_grad]
        start = [p.detach().clone() for p in params]

        def restore():
            with torch.no_grad():
                for p, s0 in zip(params, start):
                    p.copy_(s0)

        def timed(label, n_streamed):
            if not cuda:  # (the dry run: one untimed pass)
                passes(model, batch, 1)
                times, peak = [0.0], 0.0
            else:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                times = cuda_time(lambda: passes(model, batch, 1), 2, 5)
                peak = torch.cuda.max_memory_allocated() / 2**30
            copies = engine.stream.copies if engine.stream else 0
            ms = 1e3 * sorted(times)[len(times) // 2]
            rows.append((name, label, n_streamed, ms, peak, copies))
            record("stream", shape=args.shape, plan=name, streamed=n_streamed,
                   step_ms=round(ms, 2), peak_gib=round(peak, 3), copies=copies)

        runs = {}
        for label in ("none", "none again"):
            restore()
            runs[label] = passes(model, batch, args.steps)
        timed("none", 0)
        L = len(model.layers)
        if not args.control:
            engine.stream_weights(model, list(range(1, L, 2)))
            if cuda:
                torch.cuda.empty_cache()
        restore()
        runs["every other"] = passes(model, batch, args.steps)
        timed("every other" if not args.control else "none (control)",
              len(engine.stream.layers) if engine.stream else 0)
        for a, b in (("none", "none again"), ("none", "every other")):
            x_, y_ = runs[a], runs[b]
            same = all(torch.equal(x[0], y[0]) and all(torch.equal(g, h)
                                                       for g, h in zip(x[1], y[1]))
                       for x, y in zip(x_, y_))
            # per step: the largest |difference| of a LoRA gradient over its largest |value|;
            # step 1 starts from the same weights (a nondeterministic kernel's spread alone),
            # later steps also carry the SGD updates' amplification of it
            worst = [max(((g.float() - h.float()).abs().max()
                          / h.float().abs().max().clamp_min(1e-30)).item()
                         for g, h in zip(x[1], y[1])) for x, y in zip(x_, y_)]
            record("stream_equal", shape=args.shape, plan=name, runs=f"{a} vs {b}",
                   bit_identical=same, max_rel_grad_diff=max(worst),
                   first_step_rel_grad_diff=worst[0], per_step=worst)
            rows.append((name, f"{a} vs {b}: " + ("bit-identical" if same else
                         "max |diff| / max |grad| per step " +
                         ", ".join(f"{v:.2e}" for v in worst)), None, None, None, None))
        engine.unstream(model)
        del model, engine
        if cuda:
            torch.cuda.empty_cache()
    print(f"\n{args.shape}, {args.rows} x {args.seq} tokens, LoRA r16 (fwd+bwd+SGD, median ms)")
    print(f"{'plan':<11} {'streamed':<14} {'layers':>6} {'ms':>8} {'peak GiB':>9} {'copies':>7}")
    for name, label, n, ms, peak, copies in rows:
        if n is None:
            print(f"{name:<11} {label}")
        else:
            print(f"{name:<11} {label:<14} {n:>6} {ms:>8.1f} {peak:>9.2f} {copies:>7}")


if __name__ == "__main__":
    main()
