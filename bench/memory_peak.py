"""Where a training step's peak GPU memory goes: records the CUDA caching allocator's events for
one step (after warm-ups), replays them, and prints what was live at the peak grouped by the
source line that allocated it (innermost leantune frame), plus a coarse timeline of allocated
bytes. Tells which tensors a lower budget would have to shed, or what room a plan has left.

    python bench/memory_peak.py --shape llama-3.1-8b --policies auto@17 auto@17+keepall:1
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from harness import hf_config, record  # noqa: E402
from speed import make_trainer, random_batch  # noqa: E402

from leantune.engine import Engine  # noqa: E402
from leantune.engine.planner import describe  # noqa: E402

MIB = 2**20


def where(frames) -> str:
    """The innermost frame in leantune (else bench/, else the innermost): 'file:line fn'."""
    for key in ("leantune", "bench"):
        for f in frames:
            if key in f["filename"]:
                name = f["filename"].split(key, 1)[1].lstrip("/")
                return f"{name}:{f['line']} {f['name']}"
    f = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
    return f"{Path(f['filename']).name}:{f['line']} {f['name']}"


def replay(trace, start_bytes: int, points: int = 24):
    """Live allocations at the peak of `trace` (one device's events) and a timeline.

    Returns (peak bytes, {site: bytes live at the peak}, [(bytes, site of the event)] sampled,
    the peak event's leantune frames outermost first). A block counts until its free is
    requested, as torch.cuda.max_memory_allocated counts (one freed while a side stream still
    reads it stays reserved a little longer); a block allocated before the trace and freed in it
    leaves `start_bytes`."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = start_bytes
    at_peak: dict[int, tuple[int, str]] = {}
    samples, peak_stack = [], []
    step = max(1, len(trace) // points)
    for i, ev in enumerate(trace):
        act = ev["action"]
        if act == "alloc":
            live[ev["addr"]] = (ev["size"], where(ev.get("frames", [])))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
                peak_stack = [where([f]) for f in reversed(ev.get("frames", []))
                              if "leantune" in f["filename"]]
        elif act == "free_requested":
            total -= live.pop(ev["addr"])[0] if ev["addr"] in live else ev["size"]
        if i % step == 0:
            samples.append((total, where(ev.get("frames", []))))
    sites: dict[str, int] = {}
    for size, site in at_peak.values():
        sites[site] = sites.get(site, 0) + size
    return peak, sites, samples, peak_stack


def main():
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--policies", nargs="+", default=["auto@17"])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    device = torch.device("cuda")
    from leantune.model.config import ModelConfig

    mcfg = ModelConfig.from_dict(hf_config(args.shape).to_dict())
    batch = random_batch(mcfg.vocab_size, args.rows, args.seq)
    for policy in args.policies:
        trainer = make_trainer(args.shape, batch, policy, 4, device)
        gpu_batch = batch.to(device)
        for _ in range(2):
            trainer.train_step([gpu_batch])
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
        trainer.train_step([gpu_batch])
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        measured = torch.cuda.max_memory_allocated()
        trace = snap["device_traces"][device.index or 0]
        peak, sites, samples, stack = replay(trace, start)
        top = sorted(sites.items(), key=lambda kv: -kv[1])[:args.top]
        plan = describe(Engine.plans(trainer.model))
        print(f"\n{args.shape} {policy}: {plan}; peak {peak / MIB:.1f} MiB replayed, "
              f"{measured / MIB:.1f} MiB measured, at:")
        for frame in stack:
            print(f"    {frame}")
        print(f"  before the step {start / MIB:9.1f} MiB (weights, optimizer state, kept ...)")
        print("  allocated during the step and live at the peak:")
        for site, b in top:
            print(f"  {b / MIB:9.1f} MiB  {site}")
        print("  timeline (MiB allocated, at):")
        for total, site in samples:
            print(f"    {total / MIB:9.1f}  {site}")
        record("memory_peak", shape=args.shape, policy=policy, plan=plan,
               before_gib=start / 2**30, replayed_peak_gib=peak / 2**30,
               measured_peak_gib=measured / 2**30,
               top={s: round(b / MIB, 1) for s, b in top})
        del trainer, gpu_batch, snap, trace
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
