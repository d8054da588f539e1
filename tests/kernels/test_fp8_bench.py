"""bench/gpu_fp8.py --tiny runs the GPU bench's code paths on the CPU in seconds: the FP8 GEMM
kernel (interpreter) against bf16 with its error and the emulation check, the bf16 and
--precision fp8 (emulated) LoRA steps, the loss curves fp8 vs bf16 and batch-1 decoding; the
table comes last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_fp8_bench_tiny(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_fp8.py"), "--tiny",
                          "--parts", "gemm", "step", "loss", "decode"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    gemms = [r for r in rows if r["section"] == "fp8_gemm"]
    steps = [r for r in rows if r["section"] == "fp8_step" and "precision" in r]
    assert [r["shape"] for r in gemms] == ["q/o", "k/v", "gate/up", "down"]
    for r in gemms:
        assert r["kernel_vs_emulation"] < 1e-2 and r["fp8_fwd_err"] < 0.06, r
        assert r["bf16_fwd_err"] < r["fp8_fwd_err"]
    assert [(r["precision"], "error" in r) for r in steps] == [("bf16", False), ("fp8", False)]
    loss = [r for r in rows if r["section"] == "fp8_loss"]
    assert len(loss) == 1 and len(loss[0]["curves"]["fp8"]) == 6
    assert loss[0]["fp8_mean_rel_gap"] < 1e-2  # (the tiny model: FP8 follows bf16 closely)
    decode = [r for r in rows if r["section"] == "fp8_decode"]
    assert [(r["precision"], r["tok_s"] > 0, r["packed_groups"], r["fp8_head"])
            for r in decode] == [("bf16", True, 0, False), ("fp8", True, 4, True),
                                 ("fp8-bf16-head", True, 4, False),
                                 ("fp8-unpacked", True, 0, False)]  # (2 layers x 2 groups)
    assert res.stdout.rstrip().splitlines()[-1].startswith("loss  tiny 6 steps")  # the table
