"""Issue 20, section 8: on the real SmolLM2-135M-Instruct, a CPU DPO run through the CLI moves the
held-out preference margin the way the data says, and PEFT, loading the adapter on transformers'
model, shows the same margin (policy = the adapter on, reference = the adapter off)."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import run_cli, smollm2_checkpoint
from leantune import assets

pytestmark = pytest.mark.slow

BETA = 0.1


def _completion_logps(model, pairs) -> torch.Tensor:
    """[P, 2] summed log-probs of each pair's chosen / rejected completion after its prompt."""
    out = []
    for item in pairs:
        row = []
        for completion in (item.chosen, item.rejected):
            ids = torch.tensor([item.prompt + completion])
            logits = model(input_ids=ids).logits[0, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            row.append(logp[len(item.prompt) - 1:].sum())
        out.append(torch.stack(row))
    return torch.stack(out)


def test_dpo_moves_the_held_out_margin_and_peft_agrees(capsys, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from leantune.data.preference import PreferenceDataset

    ckpt = smollm2_checkpoint()
    rows = assets.path("data/demo_preference.jsonl").read_text().splitlines()
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text("\n".join(rows[:32]) + "\n")
    held_out.write_text("\n".join(rows[32:]) + "\n")
    out = tmp_path / "dpo"
    rc, stdout, err = run_cli(
        capsys, "train", "--model", ckpt, "--data", train, "--eval-data", held_out,
        "--objective", "dpo", "--beta", str(BETA), "--output", out, "--max-steps", "8",
        "--batch-size", "4", "--lr", "5e-4", "--warmup-steps", "0", "--lora-r", "8",
        "--lora-alpha", "16", "--max-seq-len", "64", "--eval-every", "0", "--device", "cpu",
        "--dtype", "float32", "--no-progress")
    assert rc == 0, err
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval_reward_margin" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and abs(first["eval_reward_margin"]) < 1e-5
    # the data prefers the right capital: the held-out margin and accuracy move that way
    assert last["eval_reward_margin"] > 0.05, stdout
    assert last["eval_reward_accuracy"] >= 0.75
    assert last["eval_loss"] < first["eval_loss"]

    # PEFT on transformers' model: the same margin on the same tokens
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    pairs = PreferenceDataset(held_out, tok, 64).items
    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(hf, str(out)).eval()
    with torch.no_grad():
        policy = _completion_logps(model, pairs)
        with model.disable_adapter():
            reference = _completion_logps(model, pairs)
    rewards = BETA * (policy - reference)  # [P, 2]
    margin = (rewards[:, 0] - rewards[:, 1]).mean().item()
    accuracy = (rewards[:, 0] > rewards[:, 1]).float().mean().item()
    assert margin == pytest.approx(last["eval_reward_margin"], rel=1e-3, abs=1e-4)
    assert accuracy == pytest.approx(last["eval_reward_accuracy"])
