"""The training step on one GPU with and without the multi-GPU machinery (issue 14).

Run it under torchrun with one process:

    torchrun --nproc_per_node 1 bench/dist_speed.py --shape llama-3.1-8b --policy auto@17
    torchrun --nproc_per_node 1 bench/dist_speed.py --shape tiny --device cpu --rows 2 \
        --seq 64 --warmup 1 --steps 2                                  (a dry run: gloo)

In one process it times leantune's Trainer step three ways: as a plain process builds it
(torchrun's variables hidden: no process group), as a torchrun process does (the process group;
at world size 1 the model runs unwrapped), and as a torchrun process with the wrapper forced
(LEANTUNE_WRAP_AT_WORLD_SIZE_1=1: DDP over the LoRA parameters, or FSDP2 with --parallel fsdp,
with the memory the planner keeps back for it), on bench/speed.py's workload: a random-init
model of the shape, LoRA r=16 alpha=16 on every projection, `--rows` rows of `--seq` random ids,
median of `--steps` steps after `--warmup`. Prints a table (what each row ran: no process group,
unwrapped, DDP or FSDP2; its activation plan, tok/s, peak memory, ratio to plain) and appends
the rows to $OUT/results.jsonl.
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

from leantune.dist.parallel import NAMES, WRAP_AT_WORLD_SIZE_1  # noqa: E402
from leantune.dist.setup import shutdown  # noqa: E402
from leantune.model.config import ModelConfig  # noqa: E402
from leantune.train.config import TrainConfig  # noqa: E402
from leantune.train.trainer import Trainer  # noqa: E402

LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def environment(hide=(), **extra):
    """`hide` removed from the environment and `extra` set, for a Trainer built inside (hiding
    torchrun's variables makes it a plain process's)."""
    saved = {k: os.environ.pop(k) for k in (*hide, *extra) if k in os.environ}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k in extra:
            os.environ.pop(k, None)
        os.environ.update(saved)


def what_ran(parallel) -> str:
    """The row's set-up as the trainer made it."""
    if not parallel.launched:
        return "no process group"
    return NAMES[parallel.kind] if parallel.kind else "unwrapped"


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


def print_table(title: str, rows) -> None:
    """rows: (run, what ran, tok/s, peak GiB, activation plan), the plain run first."""
    plain = rows[0][2]
    print(title)
    print(f"{'run':<22} {'ran':<17} {'tok/s':>8} {'peak GiB':>9} {'vs plain':>9}  plan")
    for name, ran, tok_s, peak, plan in rows:
        print(f"{name:<22} {ran:<17} {tok_s:>8,.0f} {peak:>9.2f} {tok_s / plain:>8.3f}x  {plan}",
              flush=True)


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False)
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
    vocab = ModelConfig.from_dict(hf_config(args.shape).to_dict()).vocab_size
    batch = random_batch(vocab, args.rows, args.seq)
    runs = [("plain", environment(hide=(*LAUNCHER_VARS, WRAP_AT_WORLD_SIZE_1))),
            ("torchrun", environment(hide=(WRAP_AT_WORLD_SIZE_1,))),
            ("torchrun, wrap forced", environment(**{WRAP_AT_WORLD_SIZE_1: "1"}))]
    rows = []
    for name, env in runs:
        with env:
            trainer = make_trainer(args.shape, batch, args.policy, args.parallel, device)
        step_s, peak = time_steps(trainer, batch.to(trainer.device), args.warmup, args.steps)
        ran = what_ran(trainer.parallel)
        rows.append((name, ran, tokens / step_s, peak, trainer.activation_policy))
        if trainer.parallel.writer:
            record("dist_speed", shape=args.shape, policy=args.policy, run=name, ran=ran,
                   world_size=trainer.parallel.world_size, plan=trainer.activation_policy,
                   tok_s=tokens / step_s, step_s=step_s, peak_gib=peak)
        world, writer = trainer.parallel.world_size, trainer.parallel.writer
        del trainer
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if writer:
        print_table(f"{args.shape} {args.policy}, torchrun world size {world}, --parallel "
                    f"{args.parallel}:", rows)
    shutdown()


if __name__ == "__main__":
    main()
