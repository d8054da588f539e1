"""bench/moe_speed.py runs on the CPU (a dry run of the H200 benchmark at tiny sizes): the MoE
layer's three implementations agree over the same weights, and leantune and transformers + PEFT
start the LoRA step from the same loss. bench/harness.py's transformers + PEFT twin of a leantune
MoE model with LoRA on attention and experts computes the same logits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import max_abs, one_torch_thread  # noqa: F401  (autouse)

from leantune.lora import LoRAConfig, apply_lora

ROOT = Path(__file__).resolve().parents[2]


def test_moe_speed_bench_dry_run(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "moe_speed.py"), "--device", "cpu",
                          "--parts", "routing", "e2e", "--routing-shape", "tiny", "--grouped", "on",
                          "--routing-iters", "1", "--routing-warmup", "0",
                          "--shapes", "tiny-gpt-oss", "--experts-row", "--rows", "1", "--seq",
                          "32", "--steps", "1", "--warmup", "0"],
                         capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    layer = [r for r in rows if r["section"] == "moe_routing"]
    assert [(r["impl"], r["lora"]) for r in layer] == [
        ("leantune", False), ("loop", False), ("transformers", False),
        ("leantune", True), ("loop", True)]
    assert layer[0]["path"] == "grouped_mm" and layer[2]["path"] == "grouped_mm"
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 for r in layer)
    assert all(r["agree"] for r in layer if r["impl"] != "leantune")
    assert layer[4]["lora_grad_diff"] is not None
    step = [r for r in rows if r["section"] == "moe_e2e"]
    assert [(r["lora"], r["tool"]) for r in step] == [
        (lora, tool) for lora in ("q,k,v,o", "q,k,v,o,experts")
        for tool in ("transformers+peft", "leantune")]
    assert not any("error" in r for r in step), step
    for hf, ours in (step[:2], step[2:]):
        assert abs(hf["loss0"] - ours["loss0"]) < 5e-3  # the same weights, B = 0: the same loss
        assert ours["ratio"] > 0 and hf["how"] == "eager / grouped_mm"
    table = [line for line in res.stdout.splitlines() if line.startswith("tiny-gpt-oss ")]
    assert len(table) == 4 and "LoRA training step" in res.stdout


@pytest.mark.parametrize("shape", ["tiny-qwen3-moe", "tiny-gpt-oss", "tiny-mixtral"])
def test_hf_peft_twin_of_a_moe_model(shape, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from harness import hf_peft_model, leantune_model

    base = leantune_model(shape, "cpu", dtype=torch.float32)
    apply_lora(base, LoRAConfig(r=4, alpha=8, targets="q,k,v,o,experts"), seed=0)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # so that every adapter counts
    twin = hf_peft_model(shape, base, "cpu", gradient_checkpointing=False).eval()
    assert sum(p.numel() for p in twin.parameters() if p.requires_grad) == \
        sum(p.numel() for p in base.parameters() if p.requires_grad)
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = base.eval()(ids).logits
        without = twin.get_base_model()
        assert max_abs(twin(input_ids=ids).logits, ours) < 1e-4
        with twin.disable_adapter():
            assert max_abs(without(input_ids=ids).logits, ours) > 1e-3  # the adapters count
