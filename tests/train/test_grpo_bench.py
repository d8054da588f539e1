"""bench/gpu_grpo.py --tiny runs on the CPU in seconds: leantune's GRPO step (rollouts by its
decode, then the step runner's train_step) and, where trl imports, transformers' generate + TRL's
GRPOTrainer loss over transformers + PEFT; the table comes last."""

from __future__ import annotations

from helpers import run_bench_tiny


def test_grpo_bench_tiny(tmp_path):
    res, rows = run_bench_tiny("gpu_grpo.py", tmp_path)
    assert res.returncode == 0, res.stderr[-2000:]
    try:
        import trl  # noqa: F401
        want = ["leantune", "trl"]
    except ImportError:
        want = ["leantune"]
    assert [r["tool"] for r in rows] == want
    for r in rows:
        assert "error" not in r, r
        assert r["step_s"] > 0 and abs(r["generation_s"] + r["training_s"] - r["step_s"]) < 1e-9
        assert r["completion_len"] == 16  # random weights, no EOS: every row to the limit
    assert res.stdout.strip().splitlines()[-1].startswith("trl / leantune") or want == ["leantune"]
