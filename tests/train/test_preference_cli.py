"""Preference training end to end through `leantune train`, as a user runs it (issue 20).

The bundled tiny Llama and data: an SFT run (module fixture), then DPO on the bundled
demo_preference.jsonl from that adapter (--adapter: folded into the base, so base + SFT is the
reference, and the final adapter stacks both for the original base); each objective for a few
steps; --precompute-reference with a resume and a changed-data refusal; full fine-tuning with
its frozen reference copy; the one-line errors; inspect-data and the plot.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from helpers import one_pair_changed
from helpers import cli_error, one_torch_thread, read_metrics, run_cli  # noqa: F401
from leantune import assets

TINY = assets.path("tiny-llama")
PAIRS = assets.path("data/demo_preference.jsonl")
SFT_DATA = assets.path("data/tiny_sft.jsonl")
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
FAST = ["--max-seq-len", "64", "--batch-size", "4", "--no-progress", "--device", "cpu",
        "--dtype", "float32", "--warmup-steps", "0"]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sft") / "sft"
    rc, _, err = run_cli_plain("train", "--model", TINY, "--data", SFT_DATA, "--output", out,
                               "--max-steps", "6", "--lr", "2e-3", "--lora-r", "4",
                               "--lora-alpha", "8", *FAST)
    assert rc == 0, err
    return out


def run_cli_plain(*args):
    """`leantune ARGS` in this process without capsys (module fixtures): (rc, out, err)."""
    import contextlib
    import io

    from leantune.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in args])
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def kto_file(tmp_path_factory) -> Path:
    """The demo pairs as KTO rows: chosen desirable, rejected undesirable."""
    path = tmp_path_factory.mktemp("kto") / "kto.jsonl"
    with open(path, "w") as f:
        for line in PAIRS.read_text().splitlines():
            r = json.loads(line)
            for key, label in (("chosen", True), ("rejected", False)):
                f.write(json.dumps({"prompt": r["prompt"], "completion": r[key],
                                    "label": label}) + "\n")
    return path


def _finite(records, keys):
    for r in records:
        for k in keys:
            if k in r:
                assert math.isfinite(r[k]), (k, r)


# ---- DPO from an SFT adapter ----------------------------------------------------------------

def test_dpo_from_the_sft_adapter_through_the_cli(capsys, sft_run, tmp_path):
    out = tmp_path / "dpo"
    rc, stdout, err = run_cli(capsys, "train", "--adapter", sft_run, "--data", PAIRS,
                              "--objective", "dpo", "--output", out, "--max-steps", "4",
                              "--lr", "5e-3", "--lora-r", "8", "--eval-fraction", "0.2",
                              "--eval-every", "2", *FAST)
    assert rc == 0, err
    assert "(the base named by --adapter)" in stdout
    assert "folded into the base weights" in stdout
    assert "data: 32 pairs -> 8 packed batches per epoch; 4 optimizer steps; eval: 8 pairs" \
        in stdout
    step_lines = [line for line in stdout.splitlines() if line.startswith("step 4/4")]
    assert step_lines and all(f"{k} " in step_lines[0] for k in PAIR_METRICS)
    records = read_metrics(out)
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert set(PAIR_METRICS) <= set(r)
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in evals] == [0, 2, 4]
    for r in evals:
        assert {f"eval_{k}" for k in PAIR_METRICS} <= set(r)
    _finite(records, ["loss", "eval_loss", *PAIR_METRICS, *(f"eval_{k}" for k in PAIR_METRICS)])
    # policy = reference before training: log 2, no margin; then the margin grows
    assert evals[0]["eval_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert evals[0]["eval_reward_margin"] == pytest.approx(0, abs=1e-6)
    assert evals[-1]["eval_reward_margin"] > 0 and evals[-1]["eval_loss"] < math.log(2)
    # the written adapter is for the original base: SFT (r 4) and DPO (r 8) factors stacked
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert (cfg["r"], cfg["lora_alpha"], cfg["use_rslora"]) == (12, 12.0, False)
    settings = json.loads((out / "run_config.json").read_text())
    assert settings["config"]["adapter"] == str(sft_run)
    assert settings["data_format"] == "messages"
    assert (out / "loss.png").exists()


def test_the_reference_is_base_plus_sft_and_the_stacked_adapter_is_their_sum(sft_run, tmp_path):
    """adapters_disabled after the fold == base + SFT adapter attached; the final stacked
    adapter on the base == the trained model (base + SFT folded, + DPO LoRA)."""
    from helpers import quiet, train_cfg
    from leantune.lora.peft_io import load_adapter
    from leantune.model.loader import load_model
    from leantune.train.objectives.preference import policy_logps, reference_logps
    from leantune.train.trainer import Trainer

    cfg = train_cfg(TINY, PAIRS, tmp_path / "dpo", objective="dpo", adapter=str(sft_run),
                    max_steps=2, lr=5e-3, lora_r=8, batch_size=4, max_seq_len=64,
                    warmup_steps=0)
    trainer = Trainer(cfg, log=quiet)
    batch = trainer.loader.pack([0, 1, 2])
    sft = load_model(TINY, dtype=torch.float32, device="cpu")
    load_adapter(sft, sft_run)
    with torch.no_grad():
        want = policy_logps(sft.eval(), batch)[0]
    torch.testing.assert_close(reference_logps(trainer.model, batch), want, rtol=1e-5, atol=1e-5)
    trainer.train()
    with torch.no_grad():
        trained = policy_logps(trainer.model.eval(), batch)[0]
    stacked = load_model(TINY, dtype=torch.float32, device="cpu")
    load_adapter(stacked, tmp_path / "dpo")
    with torch.no_grad():
        got = policy_logps(stacked.eval(), batch)[0]
    torch.testing.assert_close(got, trained, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(trained, want)  # (the DPO LoRA did move the model)


# ---- every objective ------------------------------------------------------------------------

@pytest.mark.parametrize("objective,extra", [
    ("dpo", ["--loss-type", "sigmoid", "--label-smoothing", "0.1"]),
    ("dpo", ["--loss-type", "ipo"]),
    ("dpo", ["--loss-type", "hinge", "--beta", "0.3"]),
    ("orpo", []),
    ("simpo", ["--simpo-gamma", "1.0", "--beta", "2.0"]),
    ("kto", ["--desirable-weight", "1.5"]),
])
def test_each_objective_trains_through_the_cli(capsys, tmp_path, kto_file, objective, extra):
    data = kto_file if objective == "kto" else PAIRS
    out = tmp_path / objective
    rc, stdout, err = run_cli(capsys, "train", "--model", TINY, "--data", data, "--objective",
                              objective, *extra, "--output", out, "--max-steps", "3",
                              "--lr", "5e-3", *FAST)
    assert rc == 0, err
    metrics = (("rewards_chosen", "rewards_rejected", "kl") if objective == "kto"
               else PAIR_METRICS)
    records = [r for r in read_metrics(out) if "loss" in r]
    assert len(records) == 3
    for r in records:
        assert set(metrics) <= set(r)
    _finite(records, ["loss", *metrics])
    assert records[-1]["loss"] < records[0]["loss"]
    unit = "80 rows" if objective == "kto" else "40 pairs"
    assert f"data: {unit} ->" in stdout
    assert (out / "adapter_model.safetensors").exists()


# ---- the precomputed reference --------------------------------------------------------------

def test_precompute_reference_resume_and_changed_data(capsys, tmp_path):
    live, pre = tmp_path / "live", tmp_path / "pre"
    common = ["--model", TINY, "--objective", "dpo", "--lr", "5e-3", "--schedule", "constant",
              *FAST]
    assert run_cli(capsys, "train", *common, "--data", PAIRS, "--output", live,
                   "--max-steps", "3")[0] == 0
    rc, stdout, err = run_cli(capsys, "train", *common, "--data", PAIRS, "--output", pre,
                              "--max-steps", "2", "--precompute-reference")
    assert rc == 0, err
    assert f"reference log-probs: computed 40 into {pre / 'reference_logps.safetensors'}" \
        in stdout
    rc, stdout, err = run_cli(capsys, "train", *common, "--data", PAIRS, "--output", pre,
                              "--max-steps", "3", "--precompute-reference", "--resume")
    assert rc == 0, err
    assert "reference log-probs: read 40 from" in stdout and "computed" not in stdout
    # the same trajectory as the reference pass each step (LoRA: the adapter-off base), the
    # resumed step included
    a = [r["loss"] for r in read_metrics(live) if "loss" in r]
    b = [r["loss"] for r in read_metrics(pre) if "loss" in r]
    assert b == pytest.approx(a, abs=1e-6)
    # the same number of pairs, one of them changed: refused in one line
    changed = one_pair_changed(PAIRS, tmp_path / "changed.jsonl")
    msg = cli_error(capsys, "train", *common, "--data", changed, "--output", pre,
                    "--max-steps", "4", "--precompute-reference", "--resume")
    # (the checkpoint's data digest sees the change first; the reference file's fingerprint
    # would refuse it too)
    assert "cannot resume: the tokenized training data (its rows, or the tokenizer or chat " \
           "template) changed since the checkpoint (data_digest" in msg
    # a reference file of another fingerprint (what another model or data would leave): its
    # own refusal
    from leantune.train.objectives.preference import load_reference, save_reference

    ref = pre / "reference_logps.safetensors"
    tables, _ = load_reference(ref)
    save_reference(ref, tables, "another")
    msg = cli_error(capsys, "train", *common, "--data", PAIRS, "--output", pre,
                    "--max-steps", "4", "--precompute-reference", "--resume")
    assert "reference_logps.safetensors: these reference log-probs were computed for other " \
           "data or another model" in msg


# ---- full fine-tuning -----------------------------------------------------------------------

def test_full_fine_tuning_dpo_builds_a_frozen_copy_and_trains(tmp_path):
    from helpers import quiet, train_cfg
    from leantune.model.loader import load_model
    from leantune.train.trainer import Trainer

    cfg = train_cfg(TINY, PAIRS, tmp_path / "full", objective="dpo", full=True, lora_r=16,
                    max_steps=3, lr=1e-4, batch_size=4, max_seq_len=64, warmup_steps=0)
    trainer = Trainer(cfg, log=quiet)
    ref = trainer.objective.reference_model
    assert ref is not None and not ref.training
    assert all(not p.requires_grad for p in ref.parameters())
    assert trainer.reference_bytes == sum(p.numel() * 4 for p in ref.parameters()) + sum(
        b.numel() * b.element_size() for b in ref.buffers())
    ptrs = {p.data_ptr() for p in trainer.model.parameters()}
    assert not ptrs & {p.data_ptr() for p in ref.parameters()}
    result = trainer.train()
    assert result.steps == 3
    base = load_model(TINY, dtype=torch.float32, device="cpu").state_dict()
    for name, p in ref.state_dict().items():  # the reference never moved
        torch.testing.assert_close(p, base[name], rtol=0, atol=0)
    moved = [n for n, p in trainer.model.state_dict().items() if not torch.equal(p, base[n])]
    assert moved
    records = [r for r in read_metrics(tmp_path / "full") if "loss" in r]
    assert records[-1]["reward_margin"] > 0
    # with --precompute-reference no copy is made
    cfg = train_cfg(TINY, PAIRS, tmp_path / "full2", objective="dpo", full=True, lora_r=16,
                    max_steps=1, precompute_reference=True, batch_size=4, max_seq_len=64)
    assert Trainer(cfg, log=quiet).objective.reference_model is None


def test_the_planner_counts_the_pair_the_reference_pass_and_the_copy():
    from helpers import CONFIGS
    from leantune.engine.planner import (BudgetTooSmall, Workload, plan_memory,
                                         plan_peak_bytes, policy_plans, reference_pass_bytes)
    from leantune.model.config import ModelConfig
    from leantune.train.config import TrainConfig
    from leantune.train.trainer import budget_message

    mc = ModelConfig.from_dict(CONFIGS["llama"])
    plans = policy_plans("recompute", mc.num_hidden_layers)
    sft = Workload(mc, 4 * 64, 2)
    pair = Workload(mc, 2 * 4 * 64, 2, reference_pass=True)
    assert plan_peak_bytes(pair, plans) >= reference_pass_bytes(pair) > 0
    assert plan_peak_bytes(pair, plans) > plan_peak_bytes(sft, plans)
    auto = Workload(mc, 2 * 4 * 64, 2, autograd=True, reference_pass=True)
    assert plan_peak_bytes(auto, plans) >= reference_pass_bytes(auto)
    full = Workload(mc, 2 * 4 * 64, 2, autograd=True, reference_pass=True,
                    reference_bytes=3 << 30)
    with pytest.raises(BudgetTooSmall) as e:
        plan_memory(full, 4 << 30, 6 << 30)
    assert e.value.reference_bytes == 3 << 30
    msg = budget_message(TrainConfig(objective="dpo", full=True, max_memory_gib=4), 4 << 30,
                         e.value)
    assert "the frozen reference copy --objective dpo needs with --full 3.00 GiB" in msg
    assert "train a LoRA adapter instead of --full" in msg and "--precompute-reference" in msg
    assert "\n" not in msg


# ---- one-line errors ------------------------------------------------------------------------

def _write(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_mismatched_objectives_and_bad_rows_are_one_line(capsys, tmp_path, kto_file, sft_run):
    base = ["train", "--model", TINY, "--output", tmp_path / "out", "--max-steps", "1", *FAST]
    msg = cli_error(capsys, *base, "--data", SFT_DATA, "--objective", "dpo")
    assert msg.startswith(f"{SFT_DATA}:1: not a preference row")
    assert msg.endswith("for SFT rows use --objective sft (the default)")
    msg = cli_error(capsys, *base, "--data", PAIRS)
    assert msg.startswith(f"{PAIRS}: cannot detect the data format")
    assert msg.endswith("these are preference pairs, which --objective sft does not read; use "
                        "--objective dpo, orpo or simpo")
    assert cli_error(capsys, *base, "--data", kto_file).endswith(
        "these are KTO rows, which --objective sft does not read; use --objective kto")
    assert cli_error(capsys, *base, "--data", PAIRS, "--objective", "kto").endswith(
        "but the file holds preference pairs; use --objective dpo, orpo or simpo")
    assert cli_error(capsys, *base, "--data", kto_file, "--objective", "orpo").endswith(
        "but the file holds KTO rows; use --objective kto")
    ok = {"prompt": "Capital of Peru?", "chosen": "Lima.", "rejected": "Quito."}
    bad = _write(tmp_path / "missing.jsonl", [ok, ok, {"prompt": "Capital of Chad?",
                                                       "chosen": "N'Djamena."}])
    assert cli_error(capsys, *base, "--data", bad, "--objective", "dpo").startswith(
        f"{bad}:3: missing field 'rejected'")
    same = _write(tmp_path / "same.jsonl", [ok, {**ok, "rejected": "Lima."}])
    assert cli_error(capsys, *base, "--data", same, "--objective", "simpo").startswith(
        f"{same}:2: the chosen and rejected completions are identical")
    mixed = _write(tmp_path / "mixed.jsonl", [ok, {"prompt": "x", "completion": "y",
                                                   "label": True}])
    assert cli_error(capsys, *base, "--data", mixed, "--objective", "dpo").startswith(
        f"{mixed}:2: a kto row in a file of pairs rows")
    label = _write(tmp_path / "label.jsonl", [{"prompt": "x", "completion": "y", "label": "maybe"}])
    assert cli_error(capsys, *base, "--data", label, "--objective", "kto").startswith(
        f"{label}:1: field 'label' must be true or false")
    # --adapter: a missing folder; a 4-bit base
    assert cli_error(capsys, *base, "--data", PAIRS, "--objective", "dpo", "--adapter",
                     tmp_path / "nope").startswith(f"--adapter {tmp_path / 'nope'}: no such folder")
    assert "a 4-bit (NF4) base cannot take" in cli_error(
        capsys, *base, "--data", PAIRS, "--objective", "dpo", "--adapter", sft_run,
        "--load-in-4bit")
    assert "--precompute-reference is a setting of --objective dpo, not of --objective orpo" \
        in cli_error(capsys, *base, "--data", PAIRS, "--objective", "orpo",
                     "--precompute-reference")


# ---- inspect-data and the plot --------------------------------------------------------------

def test_inspect_data_shows_pairs(capsys):
    rc, out, err = run_cli(capsys, "inspect-data", "--model", TINY, "--data", PAIRS, "--rows", "1")
    assert rc == 0, err
    assert out.startswith(f"{PAIRS}: 40 pairs (conversational)")
    assert f"pair 1 ({PAIRS}:1): prompt 13 tokens; chosen 8 trained, rejected 8 trained" in out
    assert "[[The capital of Cuba is Havana.<|eos|>]]" in out
    assert "[[The capital of Cuba is Brasilia.<|eos|>]]" in out
    assert "What is the capital of Cuba?" in out.split("chosen:")[0]
    assert "sequences: 80 sequences (2 per pair" in out
    assert "truncated: 0 prompts cut from the left, 0 pairs with completions cut" in out


def test_inspect_data_shows_kto_rows(capsys, kto_file):
    rc, out, err = run_cli(capsys, "inspect-data", "--model", TINY, "--data", kto_file,
                           "--rows", "2", "--max-seq-len", "16")
    assert rc == 0, err
    assert f"row 2 ({kto_file}:2, undesirable)" in out
    assert "prompts cut from the left" in out.splitlines()[0]  # 13 + 8 > 16: cut


def test_plot_draws_the_reward_panel(tmp_path):
    pytest.importorskip("matplotlib")
    from leantune.train.plot import plot_metrics

    run = tmp_path / "run"
    run.mkdir()
    recs = [{"step": s, "loss": 0.69 - 0.01 * s, "lr": 1e-3, "reward_margin": 0.1 * s,
             "reward_accuracy": min(1.0, 0.3 * s)} for s in range(1, 5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    with_rewards = plot_metrics(run, tmp_path / "a.png")
    for r in recs:
        del r["reward_margin"], r["reward_accuracy"]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    without = plot_metrics(run, tmp_path / "b.png")
    from PIL import Image

    # the reward panel makes the figure taller (7.5 in instead of 4.5)
    assert Image.open(with_rewards).size[1] > Image.open(without).size[1] * 1.5


# ---- resume --------------------------------------------------------------------------------

def test_resume_of_a_dpo_run_from_an_adapter_folds_it_again(capsys, sft_run, tmp_path):
    """A resumed --adapter run continues exactly (the SFT adapter folded again, the new LoRA
    from the checkpoint); another --adapter on resume is refused in one line."""
    common = ["train", "--adapter", sft_run, "--data", PAIRS, "--objective", "dpo", "--lr",
              "5e-3", "--schedule", "constant", "--lora-r", "8", *FAST]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli(capsys, *common, "--output", straight, "--max-steps", "3")[0] == 0
    assert run_cli(capsys, *common, "--output", resumed, "--max-steps", "2")[0] == 0
    rc, out, err = run_cli(capsys, *common, "--output", resumed, "--max-steps", "3", "--resume")
    assert rc == 0, err
    assert "folded into the base weights" in out and "resumed from" in out
    a = [r["loss"] for r in read_metrics(straight) if "loss" in r]
    b = [r["loss"] for r in read_metrics(resumed) if "loss" in r]
    assert b == pytest.approx(a, abs=1e-6)
    from safetensors.torch import load_file

    sa, sb = (load_file(str(p / "adapter_model.safetensors")) for p in (straight, resumed))
    assert sa.keys() == sb.keys()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-5, atol=1e-6)
    other = tmp_path / "other-sft"
    import shutil

    shutil.copytree(sft_run, other)
    msg = cli_error(capsys, *[other if a == sft_run else a for a in common], "--output",
                    resumed, "--max-steps", "4", "--resume")
    assert "the run was started with --adapter" in msg


def test_full_fine_tuning_with_precompute_reference_evaluates_and_resumes(capsys, tmp_path):
    """--full --precompute-reference: no copy; the eval pairs' reference log-probs are in the
    file too (the trained weights are no reference), and a resume reads them."""
    out = tmp_path / "full"
    common = ["train", "--model", TINY, "--data", PAIRS, "--objective", "dpo", "--full",
              "--precompute-reference", "--eval-fraction", "0.2", "--lr", "1e-4",
              "--output", out, *FAST]
    rc, stdout, err = run_cli(capsys, *common, "--max-steps", "2")
    assert rc == 0, err
    from leantune.train.objectives.preference import load_reference

    tables, _ = load_reference(out / "reference_logps.safetensors")
    assert tables["train"].shape == (32, 2) and tables["eval"].shape == (8, 2)
    rc, stdout, err = run_cli(capsys, *common, "--max-steps", "3", "--resume")
    assert rc == 0, err
    assert "reference log-probs: read 32" in stdout
    evals = [r for r in read_metrics(out) if "eval_reward_margin" in r]
    assert evals[0]["eval_reward_margin"] == pytest.approx(0, abs=1e-6)
    assert evals[-1]["eval_reward_margin"] != 0
    (out / "reference_logps.safetensors").unlink()
    msg = cli_error(capsys, *common, "--max-steps", "4", "--resume")
    assert "a resumed --full run cannot compute its reference log-probs again" in msg
