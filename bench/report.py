"""Print the results of a GPU run ($OUT/results.jsonl) as short tables."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main():
    path = Path(sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "bench-out")) / "results.jsonl"
    rows = [json.loads(line) for line in open(path)] if path.exists() else []
    for r in rows:
        if r["section"] in ("env", "gpu_check"):
            print(" ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()
                           if k != "section"))
    print("\n| kernel | triton fwd+bwd ms | eager fwd+bwd ms | speedup | extra peak GiB (triton/eager) | max rel err |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        if r["section"] == "kernel":
            print(f"| {r['kernel']} | {r['triton_fwd_bwd_ms']:.3f} | {r['eager_fwd_bwd_ms']:.3f} | "
                  f"{r['speedup']:.2f}x | {r['triton_extra_peak_gib']:.2f} / {r['eager_extra_peak_gib']:.2f} | "
                  f"{r['max_rel_err']:.1e} |")
    print("\n| shape | impl | activations | tok/s | peak GiB | MFU | vs HF | plan |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["section"] == "speed":
            if "error" in r:
                print(f"| {r['shape']} | {r['impl']} | {r['policy']} | {r['error']} | | | | |")
                continue
            ratio = f"{r['ratio']:.3f}x" if r.get("ratio") else ""
            print(f"| {r['shape']} | {r['impl']} | {r['policy']} | {r['tok_s']:,.0f} | "
                  f"{r['peak_gib']:.3f} | {100 * r['mfu']:.1f}% | {ratio} | {r.get('plan', '')} |")
    print("\n| shape | policy | plan | peak GiB | largest allocations live at the peak (MiB) |")
    print("|---|---|---|---|---|")
    for r in rows:
        if r["section"] == "memory_peak":
            top = ", ".join(f"{site} {mib:,.0f}" for site, mib in list(r["top"].items())[:4])
            print(f"| {r['shape']} | {r['policy']} | {r['plan']} | {r['measured_peak_gib']:.2f} | "
                  f"{top} |")
    print("\n| shape | dtype | leantune tok/s | HF+PEFT tok/s | max / mean loss gap | noise floor "
          "max / mean | first->last (ours) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if r["section"] == "loss_curve":
            floor = (f"{100 * r['floor_max_rel_gap']:.3f}% / {100 * r['floor_mean_rel_gap']:.3f}%"
                     if "floor_max_rel_gap" in r else "")
            print(f"| {r['shape']} | {r['dtype'].replace('torch.', '')} | {r['ours_tok_s']:,.0f} | "
                  f"{r['hf_tok_s']:,.0f} | {100 * r['max_rel_gap']:.2e}% / "
                  f"{100 * r['mean_rel_gap']:.2e}% | {floor} | "
                  f"{r['ours_first_last'][0]:.3f}->{r['ours_first_last'][1]:.3f} |")


if __name__ == "__main__":
    main()
