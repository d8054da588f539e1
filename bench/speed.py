"""Issue 3: the LoRA training step, leantune vs transformers + PEFT in the same run.

Workload (as ../shared/ARCHITECTURE.md): random-init model of the named shape, bf16, LoRA r=16
alpha=16 on q,k,v,o,gate,up,down, 4 rows x 2048 tokens of random ids, fused AdamW on the LoRA
parameters, median of 8 steps after 3 warm-ups, peak = torch.cuda.max_memory_allocated.
Baseline: transformers + PEFT, SDPA, non-reentrant gradient checkpointing, loss from
model(input_ids, labels=...).

    python bench/speed.py --shape llama-3.2-1b llama-3.1-8b --policies recompute keep
    python bench/speed.py --tiny   # the same code on the CPU in seconds (tiny-* shapes, fp32)
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import (H200_BF16_FLOPS, cuda_time, flops_per_token, hf_peft_model,  # noqa: E402
                     leantune_model, median, record, trainable)

TINY_SHAPES = ["tiny", "tiny-gemma3", "tiny-phi3"]

from leantune.batch import IGNORE_INDEX, PackedBatch  # noqa: E402
from leantune.train.config import TrainConfig  # noqa: E402
from leantune.train.trainer import Trainer  # noqa: E402


def random_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> PackedBatch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    docs = [[(r.tolist(), r[1:].tolist() + [IGNORE_INDEX])] for r in ids]
    return PackedBatch.from_documents(docs, pad_to_multiple=1)


def make_trainer(shape, batch, policy, steps, device, lora_targets="q,k,v,o,gate,up,down"):
    """A Trainer for `policy`: "recompute" | "offload" | "keep" | "auto@GiB" (memory-budgeted) |
    "offload:N[k0]" (hand plan), optionally "+compile", "+nofused" (autograd layers instead of
    the hand-written backward), "+noembed" (input embedding kept on the GPU), "+keepall:M"
    (the last M layers keep everything, on top of the plan), "+offall:M" (the last M offloaded
    layers of the plan keep everything, still offloaded), "+fp8" (--precision fp8), "+stream"
    (EngineOptions.stream_weights: the planner may stream base weights from the host), "+gemmres"
    (EngineOptions.gemm_residual: down's residual added by its cuBLAS GEMM), "+streammax:K"
    (with +stream: at most K layers streamed, EngineOptions.stream_max_layers), "+fillahead"
    (EngineOptions.stream_fill_ahead on)."""
    base = leantune_model(shape, device, dtype=_dtype(device))
    ckpt, *extras = policy.split("+")
    ckpt, _, budget = ckpt.partition("@")
    ckpt, _, n_off = ckpt.partition(":")  # "offload:N[k0]": the first N layers offloaded
    keep_all = [int(e.partition(":")[2] or 1) for e in extras if e.startswith("keepall")]
    off_all = [int(e.partition(":")[2] or 1) for e in extras if e.startswith("offall")]
    cfg = TrainConfig(output=tempfile.mkdtemp(), max_seq_len=batch.input_ids.shape[1],
                      batch_size=batch.input_ids.shape[0], lr=1e-4, warmup_steps=0,
                      max_steps=steps, progress=False, eval_every=0, lora_r=16, lora_alpha=16,
                      lora_targets=lora_targets, overwrite=True, device=str(device),
                      activations=ckpt,
                      max_memory_gib=float(budget) if budget else None,
                      compile="compile" in extras, fused_layers="nofused" not in extras,
                      offload_embedding="noembed" not in extras,
                      precision="fp8" if "fp8" in extras else "bf16",
                      stream_weights="stream" in extras, gemm_residual="gemmres" in extras,
                      stream_fill_ahead="fillahead" in extras,
                      stream_max_layers=next((int(e.partition(":")[2]) for e in extras
                                              if e.startswith("streammax:")), 0))
    docs = [(batch.input_ids[0].tolist(), batch.labels[0].tolist())]
    trainer = Trainer(cfg, model=base, train_data=docs, log=lambda *a: None)
    from leantune.engine import Engine, LayerPlan

    plans = Engine.plans(trainer.model)
    L = len(plans)
    if n_off:  # hand-made plan: N layers offloaded, the rest keep attention state (or input)
        inputs_only = n_off.endswith("k0")
        n = int(n_off[:-2] if inputs_only else n_off)
        if not 0 < n < L:
            raise SystemExit(f"offload:{n_off}: N must be 1..{L - 1} for {L} layers")
        rest = LayerPlan(0) if inputs_only else LayerPlan(1)
        plans = [LayerPlan(1, offload=True)] * n + [rest] * (L - n - 1) + [LayerPlan(1)]
    if keep_all:
        plans = plans[:L - keep_all[0]] + [LayerPlan(2)] * keep_all[0]
    if off_all:
        offloaded = [i for i, p in enumerate(plans) if p.offload]
        for i in offloaded[len(offloaded) - off_all[0]:]:
            plans[i] = LayerPlan(2, offload=True)
    if n_off or keep_all or off_all:
        trainer.engine.attach(trainer.model, plans)
    return trainer


def _dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32  # (--tiny: fp32 on the CPU)


def _timed(fn, warmup, steps, device) -> tuple[list[float], float]:
    """Step times and peak GiB (0 on the CPU, where there is no peak counter)."""
    if device.type != "cuda":
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return times, 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = cuda_time(fn, warmup, steps)
    return times, torch.cuda.max_memory_allocated() / 2**30


def bench_ours(shape, batch, policy, warmup, steps, device):
    """Median step time and peak GiB of leantune's step under `policy` (make_trainer)."""
    trainer = make_trainer(shape, batch, policy, steps, device)
    gpu_batch = batch.to(device)
    times, peak = _timed(lambda: trainer.train_step([gpu_batch]), warmup, steps, device)
    plan = trainer.activation_policy
    print(f"{shape} {policy}: {plan}", flush=True)
    trainer.engine.unstream(trainer.model)  # (streamed weights: the stream and the model refer
    del trainer                             # to each other until unstreamed)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return median(times), peak, plan


def bench_hf(shape, batch, warmup, steps, device):
    from leantune.lora import LoRAConfig, apply_lora

    base = leantune_model(shape, device, dtype=_dtype(device))
    apply_lora(base, LoRAConfig(r=16, alpha=16), dtype=torch.float32)
    pm = hf_peft_model(shape, base, device, gradient_checkpointing=True)
    pm.train()
    params = trainable(pm)
    opt = torch.optim.AdamW(params, lr=1e-4, fused=True)
    ids = batch.input_ids.to(device)

    def step():
        out = pm(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    times, peak = _timed(step, warmup, steps, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return median(times), peak


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--shape", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"])
    ap.add_argument("--policies", nargs="+", default=["recompute"],
                    help="leantune policies to time: recompute | offload | keep | auto@GiB | "
                         "offload:N (the first N layers offloaded, the rest keep their attention "
                         "state; offload:Nk0: their input), each optionally +compile, +nofused, "
                         "+noembed (input embedding kept on the GPU), +keepall:M (the last M "
                         "layers keep everything)")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--tiny", action="store_true",
                    help="CPU dry run of the same code: tiny shapes of every dense family "
                         f"(default {' '.join(TINY_SHAPES)}), 2 rows x 64 tokens, fp32")
    args = ap.parse_args()
    device = torch.device("cuda")
    if args.tiny:
        device = torch.device("cpu")
        if args.shape == ap.get_default("shape"):
            args.shape = TINY_SHAPES
        args.rows, args.seq, args.warmup, args.steps = 2, 64, 1, 2
    table = []
    from harness import hf_config
    from leantune.model.config import ModelConfig

    for shape in args.shape:
        mcfg = ModelConfig.from_dict(hf_config(shape).to_dict())
        batch = random_batch(mcfg.vocab_size, args.rows, args.seq)
        tokens = args.rows * args.seq
        fpt = flops_per_token(mcfg, args.seq)
        hf = None
        if not args.no_baseline:
            t, peak = bench_hf(shape, batch, args.warmup, args.steps, device)
            hf = tokens / t
            record("speed", shape=shape, impl="hf+peft", policy="recompute", tok_s=hf,
                   step_s=t, peak_gib=peak, mfu=fpt * hf / H200_BF16_FLOPS)
        for policy in args.policies:
            try:
                t, peak, plan = bench_ours(shape, batch, policy, args.warmup, args.steps,
                                           device)
            except Exception as e:  # OOM, or a compile failure: record it and go on
                record("speed", shape=shape, impl="leantune", policy=policy,
                       error=f"{type(e).__name__}: {str(e)[:200]}")
                torch.cuda.empty_cache()
                continue
            tok_s = tokens / t
            record("speed", shape=shape, impl="leantune", policy=policy, plan=plan, tok_s=tok_s,
                   step_s=t, peak_gib=peak, mfu=fpt * tok_s / H200_BF16_FLOPS,
                   ratio=(tok_s / hf) if hf else None)
            table.append((shape, policy, hf, tok_s, peak))
    print(f"{'shape':<16} {'policy':<12} {'hf+peft tok/s':>14} {'leantune tok/s':>15} "
          f"{'ratio':>6} {'peak GiB':>9}")
    for shape, policy, hf, tok_s, peak in table:
        ratio = f"{tok_s / hf:6.2f}" if hf else "     -"
        print(f"{shape:<16} {policy:<12} {hf or 0:14.0f} {tok_s:15.0f} {ratio} {peak:9.2f}")


if __name__ == "__main__":
    main()
