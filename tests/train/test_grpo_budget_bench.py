"""bench/gpu_grpo_budget.py --tiny: the real Trainer with --objective grpo (random-id prompts,
a random-weight tiny model) plans, generates and trains its steps on the CPU; the row names the
plan and the steps (the peak is measured on the GPU only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_grpo_budget_bench_tiny(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_grpo_budget.py"), "--tiny"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "step 2/2" in res.stdout  # the trainer's own loop ran both steps
    (row,) = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert row["section"] == "grpo_budget" and row["steps"] == 2 and row["plan"] == "keep"
    assert row["peak_gib"] is None and row["within"] is None  # (no peak on the CPU)
    assert res.stdout.strip().splitlines()[-1].startswith("tiny")
