"""GRPO's rollouts under each decode-projections mode (generate/projections.py): the same seed
gives the same completions, rewards, advantages and loss whether the decode step runs the
model's own projections or the packed ones (a tiny fp32 Llama whose weights an engine packed,
as the trainer's are). A rollouts' KV cache too large for free memory names GRPO's flags."""

from __future__ import annotations

import pytest
import torch
from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401  (autouse)

from leantune.data.prompts_data import PromptBatch, PromptItem
from leantune.engine import Engine, LayerPlan
from leantune.errors import LeantuneError
from leantune.train.config import TrainConfig
from leantune.train.objectives.grpo import GRPOObjective, completion_logps
from leantune.train.rewards import RewardFunction


class _Prompts:
    fields: list = []
    source = "<test prompts>"

    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.items = [PromptItem("", torch.randint(3, 60, (n,), generator=g).tolist())
                      for n in (5, 8)]
        self.longest = 8

    def where(self, i):
        return f"prompt {i}"


def _objective(tmp_path, mode: str) -> GRPOObjective:
    cfg = TrainConfig(objective="grpo", reward=["builtin:length-penalty"], num_generations=3,
                      max_completion_tokens=6, max_seq_len=16, batch_size=2, temperature=0.9,
                      top_p=0.95, output=str(tmp_path / mode), max_steps=10).validate()
    obj = GRPOObjective(cfg, log=lambda *a: None)
    obj.rewards = [RewardFunction("ids", lambda completion_ids, **kw: [
        float(sum(c) % 7) for c in completion_ids])]
    obj.eos_ids = [2]
    obj.dataset = _Prompts()
    obj.decode_projections = mode
    return obj


def test_rollouts_and_loss_are_the_same_in_every_mode(tmp_path):
    model = model_for(CONFIGS["llama"])
    engine = Engine()
    engine.attach(model, [LayerPlan(2)] * len(model.layers))
    engine.pack(model)
    runs = {}
    for mode in ("plain", "precast", "packed"):
        obj = _objective(tmp_path, mode)
        prompts = PromptBatch(obj.dataset.items, [0, 1])
        windows = [obj.generate_window(model, [prompts], step) for step in (0, 1)]
        rb = windows[1][0]
        with torch.no_grad():
            loss = (obj.loss(model, rb).loss_sum,
                    completion_logps(model, rb.batch, rb.index, rb.mask, 0.9))
        runs[mode] = (windows, loss, obj.rollout_metrics["reward"])
    (ref, ref_loss, ref_reward) = runs["plain"]
    for mode in ("precast", "packed"):
        windows, loss, reward = runs[mode]
        for w, r in zip(windows, ref):
            assert torch.equal(w[0].batch.input_ids, r[0].batch.input_ids)
            assert torch.equal(w[0].advantages, r[0].advantages)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert ref_loss[1].abs().sum() > 0
        assert reward == ref_reward
    assert not torch.equal(ref[0][0].batch.input_ids, ref[1][0].batch.input_ids)  # steps differ


def test_a_rollout_cache_too_large_names_grpo_flags(tmp_path, monkeypatch):
    """The KV cache of the rollouts past free memory is one line naming GRPO's train flags, not
    generate's (--batch-size x --num-generations rows); generate keeps its own."""
    import leantune.generate.cache as cache

    model = model_for(CONFIGS["llama"])
    obj = _objective(tmp_path, "plain")
    monkeypatch.setattr(cache, "free_bytes", lambda device: 2**10)
    with pytest.raises(LeantuneError) as e:
        obj.generate_window(model, [PromptBatch(obj.dataset.items, [0, 1])], 0)
    msg = str(e.value)
    assert msg.startswith("generating 6 completions together needs a KV cache of "), msg
    assert msg.endswith(
        "cpu has 1 KiB free; give fewer prompts a micro-batch (--batch-size; a larger "
        "--grad-accum keeps the prompts a step) or fewer completions per prompt "
        "(--num-generations), shorter prompts (--max-prompt-len) or fewer "
        "--max-completion-tokens"), msg
    assert "--max-new-tokens" not in msg
    # outside the rollouts the check is generate's again
    with pytest.raises(LeantuneError, match=r"^generating 2 prompts together .*give fewer "
                                            r"prompts at a time \(--batch-size\), shorter "
                                            r"prompts or fewer new tokens \(--max-new-tokens\)$"):
        cache.check_fits(model.config, 2, 64, torch.float32, torch.device("cpu"))
