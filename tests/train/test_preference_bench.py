"""bench/gpu_preference.py --tiny runs on the CPU in seconds: leantune's DPO step (reference pass
each step, and precomputed), and TRL's DPOTrainer loss over transformers + PEFT where trl
imports, start from the same loss (the same weights, LoRA B = 0: policy = reference, ln 2)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_preference_bench_tiny(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_preference.py"), "--tiny",
                          "--precompute-reference"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    tools = [r["tool"] for r in rows]
    try:
        import trl  # noqa: F401
        want = ["leantune", "leantune 2-doc", "leantune+precompute", "leantune+precompute 2-doc",
                "trl"]
    except ImportError:
        want = ["leantune", "leantune 2-doc", "leantune+precompute", "leantune+precompute 2-doc"]
    assert tools == want
    for r in rows:
        assert "error" not in r, r
        assert r["tokens_per_step"] == 2 * 2 * 32 and r["tokens_per_s"] > 0
        assert abs(r["loss0"] - math.log(2)) < 1e-5, r
    assert rows[2]["prepare_s"] is not None
    assert rows[0]["pass_tokens"] < rows[1]["pass_tokens"]  # the shared prompt runs once
    assert "tokens/s" in res.stdout and "leantune " in res.stdout
