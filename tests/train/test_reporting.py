"""`--report-to`: TensorBoard event files (read back with TensorBoard's own reader) and Weights &
Biases (a fake `wandb` module: no network) get the records of metrics.jsonl; one-line errors for
bad names, missing packages and a failing wandb.init."""

from __future__ import annotations

import sys
import types

import pytest
from helpers import FAST, cli_error, read_metrics, run_cli
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401  (fixtures)

from leantune.errors import LeantuneError
from leantune.train.reporting import (
    TENSORBOARD_DIR,
    TensorBoardReporter,
    check_report_to,
    parse_report_to,
)

def train(capsys, *args):
    return run_cli(capsys, "train", *args)


def scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def expected(records, key) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


@pytest.mark.parametrize("value, names", [
    (None, []), ("none", []), ("NONE", []), ("tensorboard", ["tensorboard"]),
    ("wandb, tensorboard", ["wandb", "tensorboard"]), ("tensorboard,tensorboard,", ["tensorboard"]),
    (["tensorboard", "wandb"], ["tensorboard", "wandb"]), ([], []),  # a YAML list
])
def test_parse_report_to(value, names):
    assert parse_report_to(value) == names


@pytest.mark.parametrize("value, message", [
    ("mlflow", "--report-to: unknown reporter 'mlflow'; use none, tensorboard, wandb, or a comma "
               "list such as tensorboard,wandb"),
    ("none,wandb", "--report-to none,wandb: 'none' cannot be combined with reporters; give none "
                   "alone, or only reporters"),
    (["wandb", "none"], "--report-to wandb,none: 'none' cannot be combined with reporters; give "
                        "none alone, or only reporters"),
])
def test_bad_report_to(value, message):
    with pytest.raises(LeantuneError) as ei:
        parse_report_to(value)
    assert str(ei.value) == message


@pytest.mark.parametrize("name, module", [("tensorboard", "torch.utils.tensorboard"),
                                          ("wandb", "wandb")])
def test_missing_package_is_one_line_before_anything_runs(name, module, monkeypatch, tiny_ckpt,  # noqa: F811
                                                          alpaca_file, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed
    with pytest.raises(LeantuneError) as ei:
        check_report_to(name)
    assert str(ei.value) == (f"--report-to {name} needs the {name} package; run `pip install "
                             f"'leantune[{name}]'`, or drop {name} from --report-to")
    assert cli_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                     tmp_path / "run", "--report-to", name, *FAST) == str(ei.value)
    assert not (tmp_path / "run").exists()  # checked before the output folder is touched


def test_tensorboard_gets_the_metrics(tiny_ckpt, alpaca_file, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
                       "--max-steps", 3, "--eval-fraction", "0.1", "--eval-every", 2,
                       "--report-to", "tensorboard", *FAST)
    assert rc == 0, err
    records = read_metrics(out)
    got = scalars(out / TENSORBOARD_DIR)
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
            "eval/loss"} <= got.keys()
    for tag, key in (("train/loss", "loss"), ("train/lr", "lr"), ("eval/loss", "eval_loss")):
        want = expected(records, key)
        assert [s for s, _ in got[tag]] == [s for s, _ in want], tag
        assert [v for _, v in got[tag]] == pytest.approx([v for _, v in want], rel=1e-6), tag
    assert [s for s, _ in got["eval/loss"]] == [0, 2, 3]


def test_tensorboard_hides_what_a_later_run_redoes(tmp_path):
    """A run replacing (or resuming) another in the same folder: TensorBoard shows the earlier
    run's events only before the new run's first step; nothing is deleted."""
    first = TensorBoardReporter(tmp_path, start_step=0)
    for step in (1, 2, 3):
        first.log({"step": step, "loss": 10.0 + step})
    first.close()
    resumed = TensorBoardReporter(tmp_path, start_step=2)
    for step in (2, 3, 4):
        resumed.log({"step": step, "loss": 20.0 + step})
    resumed.close()
    assert scalars(tmp_path / TENSORBOARD_DIR)["train/loss"] == [(1, 11.0), (2, 22.0), (3, 23.0),
                                                                 (4, 24.0)]
    assert len(list((tmp_path / TENSORBOARD_DIR).iterdir())) == 2


class FakeWandb(types.ModuleType):
    """The part of the wandb API leantune uses, recording the calls."""

    def __init__(self, fail=None):
        super().__init__("wandb")
        self.fail = fail
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kwargs):
        if self.fail:
            raise self.fail
        self.inits.append(kwargs)
        return self

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.finished += 1


def test_wandb_gets_the_metrics(tiny_ckpt, alpaca_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_PROJECT", "my-project")
    out = tmp_path / "my-run"
    rc, _, err = train(capsys, "--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
                       "--max-steps", 2, "--eval-fraction", "0.1", "--lr", "3e-4",
                       "--report-to", "wandb", *FAST)
    assert rc == 0, err
    [init] = fake.inits
    assert (init["project"], init["name"], init["dir"]) == ("my-project", "my-run", str(out))
    assert init["config"]["lr"] == 3e-4 and init["config"]["report_to"] == "wandb"
    assert fake.finished == 1
    records = read_metrics(out)
    assert [step for step, _ in fake.logged] == [r["step"] for r in records]
    for (_, values), record in zip(fake.logged, records):
        want = {("eval/loss" if k == "eval_loss" else f"train/{k}"): v
                for k, v in record.items() if k != "step"}
        assert values == want


def test_wandb_init_failure_is_one_line(tiny_ckpt, alpaca_file, tmp_path, capsys,  # noqa: F811
                                        monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(fail=RuntimeError("api key\nnot set")))
    assert cli_error(capsys, "train", "--model", tiny_ckpt, "--data", alpaca_file, "--output",
                     tmp_path / "run", "--max-steps", 1, "--report-to", "wandb", *FAST) == (
        "--report-to wandb: wandb.init failed (RuntimeError: api key not set); run `wandb "
        "login`, or set WANDB_MODE=offline to log locally")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # a rerun needs no --overwrite
