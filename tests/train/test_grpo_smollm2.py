"""Issue 21, section 6: on the real SmolLM2-135M-Instruct, a CPU GRPO run through the CLI with a
reward file (a brevity reward on one-sentence prompts) raises the mean reward within a dozen
steps, and PEFT loads the adapter on transformers' model (its logits equal leantune's with the
adapter)."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

from helpers import run_cli, smollm2_checkpoint, write_jsonl

pytestmark = pytest.mark.slow

TOPICS = ["the sea", "a cat", "Paris", "winter", "coffee", "music", "trees", "the moon", "rain",
          "books", "a dog", "bread"]

REWARDS = '''
def brevity(completions, **kwargs):
    """1.0 for an answer of at most 12 words, falling to 0 at 36 words."""
    return [max(0.0, min(1.0, (36 - len(c[0]["content"].split())) / 24)) for c in completions]
'''


def test_grpo_raises_the_reward_and_peft_loads_the_adapter(capsys, tmp_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from leantune.lora import load_adapter
    from leantune.model.loader import load_model

    ckpt = smollm2_checkpoint()
    data = write_jsonl(tmp_path / "topics.jsonl", [
        {"prompt": [{"role": "user", "content": f"Write one sentence about {t}."}]}
        for t in TOPICS])
    (tmp_path / "rewards.py").write_text(REWARDS)
    out = tmp_path / "grpo"
    rc, stdout, err = run_cli(
        capsys, "train", "--model", ckpt, "--data", data, "--objective", "grpo",
        "--reward", f"{tmp_path / 'rewards.py'}:brevity", "--num-generations", "4",
        "--batch-size", "2", "--max-completion-tokens", "32", "--max-seq-len", "128",
        "--max-steps", "12", "--warmup-steps", "2", "--lr", "1e-3", "--device", "cpu",
        "--dtype", "float32",
        "--no-progress", "--output", out)
    assert rc == 0, err
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward"] for r in rows if "reward" in r]
    # 12 steps at lr 1e-3 (seeds 1, 2 and 42 tried): the first three steps' mean reward is
    # near 0.6, the last three's near 1.0.
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.2, rewards

    base = AutoModelForCausalLM.from_pretrained(ckpt, trust_remote_code=False,
                                                torch_dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, out)
    ours = load_model(ckpt, dtype=torch.float32, device=torch.device("cpu"))
    load_adapter(ours, out)
    ids = torch.tensor([[1, 504, 3458, 314, 260, 1789, 30]])
    with torch.no_grad():
        theirs = pm(input_ids=ids).logits
        mine = ours(ids).logits
        with pm.disable_adapter():
            plain = pm(input_ids=ids).logits
    assert (theirs - mine).abs().max() < 1e-3
    assert (theirs - plain).abs().max() > 1e-4  # the adapter trained
