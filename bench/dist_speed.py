"""The training step on one GPU with and without the multi-GPU machinery (issue 14).

Run it under torchrun with one process:

    torchrun --nproc_per_node 1 bench/dist_speed.py --shape llama-3.1-8b --policy auto@17
    torchrun --nproc_per_node 1 bench/dist_speed.py --shape tiny --device cpu --rows 2 \
        --seq 64 --warmup 1 --steps 2                                  (a dry run: gloo)

In one process it times leantune's Trainer step first as a plain process builds it (torchrun's
variables hidden: no process group, no wrapper), then as a torchrun process does (the process
group, and DDP over the LoRA parameters, or FSDP2 with --parallel fsdp), on bench/speed.py's
workload: a random-init model of the shape, LoRA r=16 alpha=16 on every projection, `--rows`
rows of `--seq` random ids, median of `--steps` steps after `--warmup`. Prints tok/s and the
peak memory of both and their ratio, and appends them to $OUT/results.jsonl.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import hf_config, leantune_model, median, record  # noqa: E402
from speed import random_batch  # noqa: E402

from leantune.dist.setup import shutdown  # noqa: E402
from leantune.model.config import ModelConfig  # noqa: E402
from leantune.train.config import TrainConfig  # noqa: E402
from leantune.train.trainer import Trainer  # noqa: E402

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def without_launcher():
    """torchrun's variables hidden, so a Trainer built inside is a plain process's."""
    saved = {k: os.environ.pop(k) for k in LAUNCHER_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def make_trainer(shape: str, batch, policy: str, parallel: str, device: torch.device):
    """A Trainer over a random-init model of `shape` for `batch`'s rows; policy: an
    --activations value, or auto@GiB (a memory budget)."""
    activations, _, budget = policy.partition("@")
    cfg = TrainConfig(output=tempfile.mkdtemp(), max_seq_len=batch.input_ids.shape[1],
                      batch_size=batch.input_ids.shape[0], lr=1e-4, warmup_steps=0,
                      max_steps=1000, progress=False, eval_every=0, lora_r=16, lora_alpha=16,
                      overwrite=True, device=device.type, activations=activations,
                      max_memory_gib=float(budget) if budget else None, parallel=parallel)
    docs = [(batch.input_ids[0].tolist(), batch.labels[0].tolist())]
    return Trainer(cfg, model=leantune_model(shape, device), train_data=docs, log=print)


def time_steps(trainer, batch, warmup: int, steps: int) -> tuple[float, float]:
    """(median step seconds, peak GiB) of trainer.train_step on `batch`."""
    cuda = trainer.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(warmup + steps):
        sync()
        t0 = time.perf_counter()
        trainer.train_step([batch])
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0
    return median(times), peak


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--policy", default="auto@17", help="--activations value, or auto@GiB")
    ap.add_argument("--parallel", choices=["ddp", "fsdp"], default="ddp")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    args = ap.parse_args()
    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("run under torchrun: torchrun --nproc_per_node 1 bench/dist_speed.py ...")
    device = torch.device(args.device)
    tokens = args.rows * args.seq
    results = {}
    vocab = ModelConfig.from_dict(hf_config(args.shape).to_dict()).vocab_size
    batch = random_batch(vocab, args.rows, args.seq)
    for name in ("plain", args.parallel):
        with without_launcher() if name == "plain" else contextlib.nullcontext():
            trainer = make_trainer(args.shape, batch, args.policy, args.parallel, device)
        step_s, peak = time_steps(trainer, batch.to(trainer.device), args.warmup, args.steps)
        results[name] = tokens / step_s
        if trainer.parallel.writer:
            record("dist_speed", shape=args.shape, policy=args.policy, run=name,
                   world_size=trainer.parallel.world_size, plan=trainer.activation_policy,
                   tok_s=tokens / step_s, step_s=step_s, peak_gib=peak)
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"{args.shape} {args.policy}: plain {results['plain']:,.0f} tok/s, under torchrun "
          f"({args.parallel}) {results[args.parallel]:,.0f} tok/s: "
          f"{results[args.parallel] / results['plain']:.3f}x", flush=True)
    shutdown()


if __name__ == "__main__":
    main()
