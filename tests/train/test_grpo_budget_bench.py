"""bench/gpu_grpo_budget.py --tiny: the real Trainer with --objective grpo (random-id prompts,
a random-weight tiny model) plans, generates and trains its steps on the CPU; the row names the
plan and the steps (the peak is measured on the GPU only)."""

from __future__ import annotations

from helpers import run_bench_tiny


def test_grpo_budget_bench_tiny(tmp_path):
    res, rows = run_bench_tiny("gpu_grpo_budget.py", tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step 2/2" in res.stdout  # the trainer's own loop ran both steps
    (row,) = rows
    assert row["section"] == "grpo_budget" and row["steps"] == 2 and row["plan"] == "keep"
    assert row["peak_gib"] is None and row["within"] is None  # (no peak on the CPU)
    assert res.stdout.strip().splitlines()[-1].startswith("tiny")
