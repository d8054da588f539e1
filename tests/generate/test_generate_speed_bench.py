"""bench/generate_speed.py runs on the CPU (a dry run of the H200 benchmark: tiny shape, no CUDA
graphs): one record per implementation and batch size, the table at the end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_generate_speed_bench_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"))
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "generate_speed.py"), "--shape",
                          "tiny", "--device", "cpu", "--batch", "1", "2", "--new", "6",
                          "--prompt-len", "5", "--runs", "1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    timed = [(r["batch"], r["impl"]) for r in rows if r["section"] == "generate"]
    assert timed == [(b, impl) for b in (1, 2)
                     for impl in ("leantune (eager)", "transformers generate")]
    assert all(r["tok_s"] > 0 for r in rows if r["section"] == "generate")
    table = res.stdout.splitlines()[-4:]
    assert [line.split()[0] for line in table] == ["1", "1", "2", "2"]
    assert all(line.endswith("6 tok") for line in table)  # greedy: the same tokens as HF
