"""--objective grpo on a tiny random Llama on the CPU (train/objectives/grpo.py): the packed
rollouts' gathered log-probs equal a plain log-softmax, an update raises the probability of the
rewarded completion, a resumed run reproduces the per-step rewards and losses (the sampling RNG
included, with and without --num-iterations), flat groups train nothing without NaN or a stall
stop, the CLI with a reward file, and one-line errors."""

from __future__ import annotations

import json
import math

import pytest
import torch

from helpers import (cli_error, make_tokenizer, one_torch_thread, quiet, read_metrics,  # noqa: F401
                     run_cli, save_tiny_checkpoint, train_cfg, write_jsonl)
from leantune.train.losses.grpo import group_advantages
from leantune.train.objectives.grpo import GRPOObjective, completion_logps, pack_rollouts

WORDS = ["world", "fox", "dog", "Paris", "France", "today"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("grpo")
    tok = make_tokenizer()
    model = save_tiny_checkpoint(root / "m", tok)
    data = write_jsonl(root / "p.jsonl", [{"prompt": f"hello {w}", "answer": f"#### {i}"}
                                          for i, w in enumerate(WORDS)])
    rewards = root / "rewards.py"
    rewards.write_text("def has_o(completions, answer, **kw):\n"
                       "    return [float(c.count('o')) for c in completions]\n"
                       "def constant(completions, **kw):\n"
                       "    return [1.0] * len(completions)\n"
                       "def broken(completions, **kw):\n"
                       "    return [1.0 / (len(c) > 1000) for c in completions]\n")
    return root, tok, model, data, rewards


def _grpo_cfg(setup, out, **kw):
    root, _, model, data, rewards = setup
    base = dict(objective="grpo", reward=[f"{rewards}:has_o"], num_generations=4,
                max_completion_tokens=6, batch_size=2, max_steps=4, schedule="constant",
                warmup_steps=0, lr=5e-3, overwrite=True)
    return train_cfg(model, data, out, **{**base, **kw})


def _tiny_lora(model_dir):
    from leantune.lora import LoRAConfig, apply_lora
    from leantune.model.loader import load_model

    m = load_model(model_dir, dtype=torch.float32, device=torch.device("cpu"))
    apply_lora(m, LoRAConfig(r=4, alpha=8), seed=0, dtype=torch.float32)
    for name, p in m.named_parameters():  # a non-zero adapter: B random too
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1)
    return m


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gathered_logps_equal_plain_log_softmax(setup, temperature):
    m = _tiny_lora(setup[2])
    prompts = [[1, 5, 9], [1, 7], [1, 5, 9]]
    comps = [[11, 12, 2], [13], [14, 15, 16, 17]]
    rb = pack_rollouts(prompts, comps, [True, True, False], torch.zeros(3), 16)
    got = completion_logps(m, rb.batch, rb.index, rb.mask, temperature)
    for i, (p, c) in enumerate(zip(prompts, comps)):
        ids = torch.tensor([p + c])
        logits = m(ids).logits[0].float() / temperature
        want = torch.log_softmax(logits, -1)[len(p) - 1:-1].gather(1, torch.tensor(c)[:, None])
        if i == 2:  # masked out (a truncated completion): 0, and no trained tokens
            assert (got[i] == 0).all() and rb.mask[i].sum() == 0
            continue
        torch.testing.assert_close(got[i, :len(c)], want[:, 0], rtol=1e-5, atol=1e-5)
        assert (got[i, len(c):] == 0).all()
    assert rb.num_tokens == 4 and rb.index.shape == (3, 4)


def test_update_raises_probability_of_rewarded_completion(setup):
    cfg = _grpo_cfg(setup, setup[0] / "unused", num_generations=2).validate()
    obj = GRPOObjective(cfg, quiet)
    m = _tiny_lora(setup[2])
    prompts, comps = [[1, 5, 9]] * 2, [[11, 12, 2], [30, 31, 2]]
    adv = group_advantages(
        torch.tensor([1.0, 0.0]), 2).advantages
    rb = pack_rollouts(prompts, comps, [True, True], adv, 16)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.5)

    def seq_logps():
        with torch.no_grad():
            return completion_logps(m, rb.batch, rb.index, rb.mask, 1.0).sum(-1)

    before = seq_logps()
    for _ in range(3):
        out = obj.loss(m, rb)
        (out.loss_sum / obj.normaliser([rb])).backward()
        opt.step()
        opt.zero_grad()
    after = seq_logps()
    assert adv[0] > 0 > adv[1]
    assert after[0] > before[0] + 0.05 and after[1] < before[1] - 0.05


def _run(cfg):
    from leantune.train.trainer import Trainer

    return Trainer(cfg, log=quiet).train()


KEYS = ("loss", "reward", "reward/has_o", "completion_len", "truncated", "grad_norm", "clip")


@pytest.mark.parametrize("iterations", [1, 2])
def test_resume_reproduces_rewards_and_losses(setup, tmp_path, iterations):
    whole = tmp_path / "whole"
    _run(_grpo_cfg(setup, whole, num_iterations=iterations))
    part = tmp_path / "part"
    _run(_grpo_cfg(setup, part, num_iterations=iterations, max_steps=1))  # stops mid batch
    _run(_grpo_cfg(setup, part, num_iterations=iterations, resume=True, overwrite=False))
    a, b = read_metrics(whole), read_metrics(part)
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in KEYS:
            assert math.isclose(ra[k], rb[k], rel_tol=1e-6, abs_tol=1e-9), (k, ra, rb)
    assert len({r["reward"] for r in a}) > 1  # the steps sample different completions
    if iterations == 2:  # the second update of a generation batch: same rollouts, new ratio
        assert a[0]["reward"] == a[1]["reward"] and a[1]["generation_s"] == 0


def test_flat_groups_train_nothing_and_do_not_stop_the_run(setup, tmp_path):
    from leantune.train.trainer import Trainer

    lines = []
    cfg = _grpo_cfg(setup, tmp_path / "flat", reward=[f"{setup[4]}:constant"], max_steps=7)
    r = Trainer(cfg, log=lines.append).train()
    rows = read_metrics(tmp_path / "flat")
    assert r.steps == 7 and len(rows) == 7
    for row in rows:
        assert row["loss"] == 0 and row["grad_norm"] == 0 and row["zero_std_groups"] == 2
        assert row["reward"] == 1.0 and row["reward_std"] == 0
    # said once, in one line, with what to do
    notes = [ln for ln in map(str, lines) if "got the same reward" in ln]
    assert len(notes) == 1 and "\n" not in notes[0], notes
    assert notes[0].startswith("note: step 1: within every group the completions got the same "
                               "reward (1), so this step trains nothing")


def test_cli_with_reward_file(setup, tmp_path, capsys):
    root, _, model, data, rewards = setup
    out = tmp_path / "run"
    rc, stdout, _ = run_cli(capsys, "train", "--model", model, "--data", data, "--output", out,
                            "--objective", "grpo", "--reward", f"{rewards}:has_o", "--reward",
                            "builtin:length-penalty", "--reward-weights", "1", "0.5",
                            "--num-generations", "3", "--max-completion-tokens", "5",
                            "--max-steps", "2", "--batch-size", "2", "--max-seq-len", "64",
                            "--lora-r", "4", "--device", "cpu", "--no-progress",
                            "--log-completions-every", "1", "--beta", "0.05",
                            "--loss-type", "grpo")
    assert rc == 0, stdout
    assert "reward" in stdout and "done: 2 steps" in stdout
    rows = read_metrics(out)
    assert {"reward/has_o", "reward/length-penalty", "kl", "train_tokens_per_s"} <= set(rows[0])
    assert rows[0]["kl"] >= 0
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6 and {"step", "prompt", "completion", "reward"} <= set(samples[0])
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    cfg = json.loads((out / "run_config.json").read_text())["config"]["objective"]
    assert cfg["beta"] == 0.05 and cfg["loss_type"] == "grpo" and cfg["num_generations"] == 3


@pytest.mark.parametrize("extra, match", [
    (["--reward", "nofile.py:f"], "--reward nofile.py:f: file nofile.py not found"),
    (["--reward", "builtin:nope"], "no such built-in reward"),
    ([], "--objective grpo needs at least one --reward"),
    (["--reward", "builtin:format", "--reward-weights", "1", "2"],
     "--reward-weights gives 2 weights for 1 --reward functions"),
    (["--reward", "builtin:format", "--num-generations", "1"],
     "--num-generations must be an integer of at least 2"),
    (["--reward", "builtin:format", "--loss-type", "sigmoid"],
     "--loss-type for --objective grpo must be one of grpo, dr_grpo, dapo, bnpo, gspo"),
    (["--reward", "builtin:exact-answer", "--eval-fraction", "0.2"],
     "--objective grpo does not evaluate yet"),
])
def test_one_line_errors(setup, capsys, extra, match):
    root, _, model, data, _ = setup
    msg = cli_error(capsys, "train", "--model", model, "--data", data, "--output",
                    root / "err", "--objective", "grpo", "--device", "cpu", *extra)
    assert match in msg


def test_grpo_flag_without_grpo_and_reward_failure(setup, capsys):
    root, _, model, data, rewards = setup
    msg = cli_error(capsys, "train", "--model", model, "--data", data, "--output", root / "e2",
                    "--num-generations", "4", "--device", "cpu")
    assert "--num-generations is a setting of --objective grpo" in msg
    msg = cli_error(capsys, "train", "--model", model, "--data", data, "--output", root / "e3",
                    "--objective", "grpo", "--reward", f"{rewards}:broken", "--device", "cpu",
                    "--max-seq-len", "64", "--max-completion-tokens", "4", "--no-progress",
                    "--max-steps", "1", "--batch-size", "2", "--num-generations", "2")
    assert msg.startswith("reward broken raised ZeroDivisionError at step 1, row ")
    assert "p.jsonl:" in msg


def test_sigterm_mid_step_checkpoints_and_resume_reproduces(setup, tmp_path):
    """SIGTERM during step 3's update (its rollouts drawn): the checkpoint of step 2 is written
    with the loader rewound, and --resume redoes step 3 exactly (same prompts, same samples)."""
    import dataclasses

    from leantune.errors import LeantuneError
    from leantune.train.trainer import Trainer
    from leantune.utils.signals import Terminated

    whole = tmp_path / "whole"
    _run(_grpo_cfg(setup, whole))
    cfg = _grpo_cfg(setup, tmp_path / "cut")
    tr = Trainer(cfg, log=quiet)
    real, calls = tr.train_step, []

    def step(window):
        calls.append(1)
        if len(calls) == 3:
            raise Terminated()
        return real(window)

    tr.train_step = step
    with pytest.raises(LeantuneError, match="terminated .SIGTERM. at step 2; checkpoint saved"):
        tr.train()
    _run(dataclasses.replace(cfg, resume=True, overwrite=False))
    a, b = read_metrics(whole), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in b] == [1, 2, 3, 4]
    for ra, rb in zip(a, b):
        for k in KEYS:
            assert math.isclose(ra[k], rb[k], rel_tol=1e-6, abs_tol=1e-9), (k, ra, rb)


def test_kept_rollouts_keep_every_batch_tensor(tmp_path):
    """The rollouts kept for a resume inside a --num-iterations window come back with every
    tensor of their batches (token_weights too: the MoE statistics' padding mask)."""
    import types

    from leantune.train.objectives.grpo import GRPOObjective, pack_rollouts

    rb = pack_rollouts([[1, 2, 3], [4, 5]], [[6, 7], [8, 9, 10, 11]], [True, True],
                       torch.tensor([0.5, -0.5]), max_seq_len=16)
    assert rb.batch.token_weights is not None and (rb.batch.token_weights == 0).any()
    held = types.SimpleNamespace(window_cache=[rb], rollout_metrics={},
                                 s=types.SimpleNamespace(num_iterations=2))
    runner = types.SimpleNamespace(output=str(tmp_path), step=1)
    GRPOObjective._save_rollouts(held, runner, 0)
    GRPOObjective._load_rollouts(held, runner, 0)
    back = held.window_cache[0].batch
    for name in ("input_ids", "labels", "position_ids", "cu_seqlens", "token_weights",
                 "target_rows"):
        assert torch.equal(getattr(back, name), getattr(rb.batch, name)), name
    assert back.seq_lens == rb.batch.seq_lens and back.max_seqlen == rb.batch.max_seqlen
