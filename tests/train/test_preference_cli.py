"""Preference training through `leantune train` (issue 20): each objective on the bundled tiny
Llama and the demo preference file, its metrics in metrics.jsonl, the held-out margin moving the
way the data says, --precompute-reference with resume and a changed-data refusal, and one line
for each objective that does not fit its data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import cli_error, read_metrics, run_cli, write_jsonl

import leantune

ASSETS = Path(leantune.__file__).parent / "assets"
MODEL = ASSETS / "tiny-llama"
PAIRS = ASSETS / "data" / "demo_preference.jsonl"
SFT = ASSETS / "data" / "tiny_sft.jsonl"
PAIR_METRICS = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")


def _train(capsys, out, *extra, data=PAIRS):
    rc, stdout, err = run_cli(capsys, "train", "--model", MODEL, "--data", data, "--output", out,
                              "--batch-size", 2, "--no-progress", *extra)
    assert rc == 0, err
    return stdout + err


@pytest.mark.parametrize("objective", [["dpo"], ["dpo", "--loss-type", "ipo"],
                                       ["dpo", "--loss-type", "hinge"], ["orpo"], ["simpo"]])
def test_each_pair_objective_trains_through_the_cli(tmp_path, capsys, objective):
    _train(capsys, tmp_path / "run", "--objective", *objective, "--max-steps", 3,
           "--eval-every", 0)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", *PAIR_METRICS)), r
        assert 0.0 <= r["reward_accuracy"] <= 1.0
    saved = json.loads((tmp_path / "run" / "run_config.json").read_text())["config"]
    assert saved["objective"]["name"] == objective[0]
    assert (tmp_path / "run" / "adapter_model.safetensors").exists()


def test_dpo_moves_the_held_out_margin_the_way_the_data_says(tmp_path, capsys):
    log = _train(capsys, tmp_path / "run", "--objective", "dpo", "--max-steps", 12,
                 "--eval-fraction", 0.2, "--eval-every", 6, "--lr", 1e-3)
    assert "32 pairs (conversational)" in log and "data: 32 pairs -> 16 packed batches" in log
    assert "eval: 8 pairs" in log
    evals = [r for r in read_metrics(tmp_path / "run") if "eval_loss" in r]
    first, last = evals[0], evals[-1]
    assert first["step"] == 0 and first["eval_reward_margin"] == pytest.approx(0.0, abs=1e-6)
    assert last["eval_reward_margin"] > 0.0 and last["eval_reward_accuracy"] >= 0.75
    assert last["eval_loss"] < first["eval_loss"]


def test_kto_trains_on_kto_rows(tmp_path, capsys):
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    kto = [{"prompt": r["prompt"], "completion": r["chosen"], "label": True} for r in rows[:8]]
    kto += [{"prompt": r["prompt"], "completion": r["rejected"], "label": False} for r in rows[:8]]
    data = write_jsonl(tmp_path / "kto.jsonl", kto)
    _train(capsys, tmp_path / "run", "--objective", "kto", "--max-steps", 2, "--eval-every", 0,
           data=data)
    rows = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert len(rows) == 2 and all(math.isfinite(r["loss"]) for r in rows)


def test_precompute_reference_resumes_and_refuses_other_data(tmp_path, capsys):
    out = tmp_path / "run"
    log = _train(capsys, out, "--objective", "dpo", "--precompute-reference", "--max-steps", 2,
                 "--save-every", 2, "--eval-every", 0)
    assert "reference log-probs: computed 40" in log
    assert (out / "reference_logps.safetensors").exists()
    log = _train(capsys, out, "--objective", "dpo", "--precompute-reference", "--max-steps", 4,
                 "--save-every", 2, "--eval-every", 0, "--resume")
    assert "reference log-probs: read 40" in log
    assert [r["step"] for r in read_metrics(out) if "loss" in r] == [1, 2, 3, 4]
    # the same run folder with other pairs: refused in one line, the table kept
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()]
    rows[0]["chosen"][-1]["content"] += " Indeed."
    other = write_jsonl(tmp_path / "other.jsonl", rows)
    msg = cli_error(capsys, "train", "--model", MODEL, "--data", other, "--output", out,
                    "--batch-size", 2, "--objective", "dpo", "--precompute-reference",
                    "--max-steps", 6, "--save-every", 2, "--resume", "--no-progress")
    assert "reference_logps.safetensors" in msg and "other data" in msg


@pytest.mark.parametrize("args, data, needle", [
    (["--objective", "kto"], PAIRS, "--objective kto reads KTO rows"),
    (["--objective", "dpo"], SFT, "not a preference row"),
    ([], PAIRS, "preference data"),  # SFT on pairs: names the objectives that read them
    (["--objective", "dpo", "--full"], PAIRS, "needs a frozen reference model"),
    (["--objective", "dpo", "--loss-type", "foo"], PAIRS, "--loss-type must be one of"),
    (["--objective", "ppo"], PAIRS, "no such objective"),
    (["--beta", "0.2"], SFT, "preference-objective setting"),
    (["--objective", "orpo", "--precompute-reference"], PAIRS, "uses no reference model"),
])
def test_an_objective_that_does_not_fit_is_one_line(tmp_path, capsys, args, data, needle):
    msg = cli_error(capsys, "train", "--model", MODEL, "--data", data, "--output",
                    tmp_path / "run", "--max-steps", 1, "--no-progress", *args)
    assert needle in msg, msg
