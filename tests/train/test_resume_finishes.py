"""A run stopped after its last checkpoint (in its final evaluation, final save, loss plot or
--merge-at-end merge) is finished by --resume: the same metrics records, samples, final adapter,
loss.png and merged/ as the uninterrupted run; a resume of a run that finished changes nothing.
A Ctrl-C / SIGTERM there says the checkpoint is saved and how to finish, not "nothing was
written". (Kills in a forked child at every kill point: utils/faults.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
from importlib.util import find_spec
from pathlib import Path

import pytest
from helpers import in_child
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401  (fixtures)
from helpers import quiet, run_cli, train_cfg

from leantune.errors import LeantuneError
from leantune.train import runner
from leantune.train.trainer import Trainer
from leantune.utils.lock import lock_path
from leantune.utils.signals import Terminated

TIMING = ("tokens_per_s", "step_time_s", "peak_mem_gib")  # (differ from run to run)
PLOTS = find_spec("matplotlib") is not None  # (loss.png: written when matplotlib is installed)


def records(out: Path, name: str = "metrics.jsonl") -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k not in TIMING}
            for line in (out / name).read_text().splitlines()]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def files(folder: Path) -> dict[Path, tuple[int, bytes]]:
    """Every file under `folder` (its lock files too): when it was written, what it holds."""
    return {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(folder.rglob("*"))
            if p.is_file()}


def finished(out: Path) -> dict:
    """What an uninterrupted run leaves, to compare: metrics (less timings), samples, the final
    adapter, merged/, whether there is a plot; and the names of every entry of the folder."""
    return {"metrics": records(out), "samples": records(out, "samples.jsonl"),
            "adapter": {n: (out / n).read_bytes() for n in ("adapter_model.safetensors",
                                                             "adapter_config.json")},
            "merged": tree(out / "merged"), "plot": (out / "loss.png").is_file(),
            "entries": sorted(p.name for p in out.iterdir())}


@pytest.fixture(scope="module")
def cfg(tiny_ckpt, alpaca_file, tmp_path_factory):  # noqa: F811
    prompts = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n{"prompt": "Hi"}\n')
    return train_cfg(tiny_ckpt, alpaca_file, tmp_path_factory.mktemp("x") / "unused",
                     max_steps=2, save_every=1, eval_every=1, eval_data=str(alpaca_file),
                     merge_at_end=True, sample_prompts=str(prompts), sample_max_new_tokens=4)


@pytest.fixture(scope="module")
def reference(cfg, tmp_path_factory):
    """The uninterrupted run (in a child, as the killed ones) and the kill points it passes."""
    tmp = tmp_path_factory.mktemp("reference")
    run = dataclasses.replace(cfg, output=str(tmp / "run"))
    trace = tmp / "trace.txt"
    assert in_child(lambda: Trainer(run, log=quiet).train(), trace=trace) == 0
    points = [line.split("\t", 1)[1] for line in trace.read_text().splitlines()]
    return finished(tmp / "run"), points


def resume(run, logs: list | None = None):
    log = quiet if logs is None else logs.append
    return Trainer(dataclasses.replace(run, resume=True), log=log).train()


def check_finished_like(out: Path, want: dict, label: str) -> None:
    got = finished(out)
    for key in want:
        assert got[key] == want[key], f"{label}: {key} differs"
    if PLOTS:
        assert (out / "loss.png").stat().st_mtime >= (out / "metrics.jsonl").stat().st_mtime, label
    assert not lock_path(out / "merged").exists(), label


def test_every_kill_after_the_last_checkpoint_is_finished_by_resume(cfg, reference, tmp_path):
    want, points = reference
    assert want["plot"] == PLOTS and want["merged"]
    assert any(r.get("eval_loss") and r["step"] == 2 for r in want["metrics"])
    last = max(i for i, p in enumerate(points, 1) if "-> step-00000002" in p)
    after = list(range(last + 1, len(points) + 1))
    labels = [points[n - 1] for n in after]
    assert any("publish" in p for p in labels) and any("loss.png" in p for p in labels) == PLOTS
    for n in after:
        label = f"kill at {n} ({points[n - 1]})"
        run = dataclasses.replace(cfg, output=str(tmp_path / f"run{n}"))
        assert in_child(lambda: Trainer(run, log=quiet).train(), kill_at=n) == "killed", label
        resume(run)
        check_finished_like(Path(run.output), want, label)


def test_every_kill_of_a_finishing_resume_is_finished_by_the_next(cfg, reference, tmp_path):
    """The resume that finishes a run is killed at each of its own kill points in turn: the
    next resume still finishes it as the uninterrupted run did."""
    want, points = reference
    template = tmp_path / "template"
    run = dataclasses.replace(cfg, output=str(template))
    first_final = points.index("write .leantune-final-save.json") + 1  # (after the evaluation)
    assert in_child(lambda: Trainer(run, log=quiet).train(), kill_at=first_final) == "killed"
    trace = tmp_path / "trace.txt"
    probe = dataclasses.replace(run, output=str(tmp_path / "probe"))
    shutil.copytree(template, probe.output)
    assert in_child(lambda: resume(probe), trace=trace) == 0
    labels = [line.split("\t", 1)[1] for line in trace.read_text().splitlines()]
    assert any("adapter_config.json" in p for p in labels) and any("merged" in p for p in labels)
    for n, label in enumerate(labels, 1):
        killed = dataclasses.replace(run, output=str(tmp_path / f"run{n}"))
        shutil.copytree(template, killed.output)
        assert in_child(lambda: resume(killed), kill_at=n) == "killed", label
        resume(killed)
        check_finished_like(Path(killed.output), want, f"kill at {n} ({label})")


def test_a_kill_in_the_final_evaluation_is_finished_by_resume(cfg, reference, tmp_path):
    """No kill point there (nothing is written): the child kills itself as the final evaluation
    starts; --resume runs it, with the eval loss of the uninterrupted run."""
    want, _ = reference
    run = dataclasses.replace(cfg, output=str(tmp_path / "run"))

    def killed_in_final_eval():
        trainer = Trainer(run, log=quiet)
        real = trainer.evaluate_metrics

        def evaluate():
            if trainer.step == trainer.total_steps:
                os.kill(os.getpid(), signal.SIGKILL)
            return real()

        trainer.evaluate_metrics = evaluate
        trainer.train()

    assert in_child(killed_in_final_eval) == "killed"
    out = Path(run.output)
    assert not any("eval_loss" in r and r["step"] == 2 for r in records(out))
    logs = []
    result = resume(run, logs)
    check_finished_like(out, want, "kill in the final evaluation")
    assert any(line.startswith(f"{out}: the run stopped after its last checkpoint (step 2) "
                               "before it finished; finishing it: the final evaluation, the "
                               "final samples, the final adapter, " + "loss.png, " * PLOTS
                               + "merged/")
               for line in logs), logs
    evals = [r["eval_loss"] for r in want["metrics"] if "eval_loss" in r]
    assert f"eval loss: {evals[0]:.4f} -> {evals[-1]:.4f}" in logs
    assert result.final_eval_loss == evals[-1] and result.steps_run == 0

    # finished now: a resume says so and changes nothing
    before = files(out.parent)
    logs = []
    resume(run, logs)
    assert any(line.startswith(f"{out}: the run already finished at step 2; nothing to do")
               for line in logs), logs
    assert files(out.parent) == before


def test_a_stale_merge_lock_of_a_dead_process_is_removed(cfg, reference, tmp_path):
    """A lock file beside OUTPUT/merged whose holder is gone (SIGKILL: the OS dropped its flock)
    goes when the next run settles the folder, even when nothing is left to merge."""
    run = dataclasses.replace(cfg, output=str(tmp_path / "run"))
    assert in_child(lambda: Trainer(run, log=quiet).train()) == 0
    lock = lock_path(Path(run.output) / "merged")
    lock.write_text("999999999\n")  # (a PID that is no process)
    resume(run)
    assert not lock.exists()


# --- Ctrl-C / SIGTERM after the last step ----------------------------------------------------

def interrupt_at(monkeypatch, where: str, interrupt=KeyboardInterrupt):
    """Raise `interrupt` in the metrics' closing after the last step (wandb's finish takes
    seconds), the final save, the plot or the merge (once)."""
    def stop(*_a, **_kw):
        raise interrupt()

    if where == "metrics close":
        real = runner.open_reporting

        def reporting(*a, **kw):
            metrics = real(*a, **kw)
            close = metrics.close
            metrics.close = lambda: (close(), stop())  # (closed, then the Ctrl-C)
            return metrics

        monkeypatch.setattr(runner, "open_reporting", reporting)
    elif where == "final save":
        monkeypatch.setattr(Trainer, "save_final", stop)
    else:
        monkeypatch.setattr(runner, "plot_after_training" if where == "plot" else "merge_at_end",
                            stop)


def stopped(fn) -> BaseException:
    """What `fn` raised (a KeyboardInterrupt too: caught here, so it fails the test, not the
    session)."""
    try:
        fn()
    except BaseException as e:  # noqa: B036
        return e
    raise AssertionError("it did not stop")


@pytest.mark.parametrize("where", ["metrics close", "final save", "plot", "merge"])
def test_ctrl_c_after_the_last_step_says_how_to_finish(cfg, reference, tmp_path, monkeypatch,
                                                       where):
    want, _ = reference
    run = dataclasses.replace(cfg, output=str(tmp_path / "run"))
    out = Path(run.output)
    with monkeypatch.context() as m:
        interrupt_at(m, where)
        e = stopped(lambda: Trainer(run, log=quiet).train())
    assert isinstance(e, LeantuneError), repr(e)
    assert str(e) == (f"interrupted (Ctrl-C) after the last step (2); its checkpoint "
                      f"{out / 'checkpoints' / 'step-00000002'} is saved; finish the run with "
                      "the same command plus --resume")
    assert e.exit_code == 130
    resume(run)
    check_finished_like(out, want, where)


def test_a_finished_run_without_its_plot_is_finished_and_the_plot_drawn(cfg, reference,
                                                                         tmp_path):
    """loss.png missing (a stop in the plot, or a plot that failed and wrote none) is no sign of
    an unfinished run: a resume says it finished, and draws the plot where matplotlib is."""
    want, _ = reference
    run = dataclasses.replace(cfg, output=str(tmp_path / "run"))
    Trainer(run, log=quiet).train()
    out = Path(run.output)
    (out / "loss.png").unlink(missing_ok=True)
    logs = []
    resume(run, logs)
    assert any(line.startswith(f"{out}: the run already finished at step 2; nothing to do")
               for line in logs), logs
    assert not any("stopped after its last checkpoint" in line for line in logs), logs
    assert (out / "loss.png").is_file() == PLOTS
    check_finished_like(out, want, "plot deleted")


def test_ctrl_c_while_a_resume_finishes_says_the_same_command_again(cfg, tmp_path, monkeypatch):
    run = dataclasses.replace(cfg, output=str(tmp_path / "run"))
    with monkeypatch.context() as m:
        interrupt_at(m, "merge")
        assert isinstance(stopped(lambda: Trainer(run, log=quiet).train()), LeantuneError)
    with monkeypatch.context() as m:
        interrupt_at(m, "merge", interrupt=Terminated)
        e = stopped(lambda: resume(run))
    assert isinstance(e, LeantuneError), repr(e)
    assert str(e).startswith("terminated (SIGTERM) after the last step (2); its checkpoint")
    assert str(e).endswith("is saved; finish the run with the same command again")
    assert e.exit_code == 143
    resume(run)
    assert (Path(run.output) / "merged" / "model.safetensors.index.json").is_file()


def test_the_cli_line_for_ctrl_c_in_the_merge(tiny_ckpt, alpaca_file,  # noqa: F811
                                              tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    args = ["train", "--model", tiny_ckpt, "--data", alpaca_file, "--output", out, "--max-steps",
            2, "--merge-at-end", "--max-seq-len", 128, "--batch-size", 2, "--lora-r", 4,
            "--no-progress", "--device", "cpu", "--dtype", "float32"]
    with monkeypatch.context() as m:
        interrupt_at(m, "merge")
        rc, _, err = run_cli(capsys, *args)
    assert rc == 130
    assert err == (f"leantune: error: interrupted (Ctrl-C) after the last step (2); its "
                   f"checkpoint {out / 'checkpoints' / 'step-00000002'} is saved; finish the run "
                   "with the same command plus --resume\n")
    rc, stdout, err = run_cli(capsys, *args, "--resume")
    assert rc == 0, err
    assert "finishing it: merged/" in stdout
    assert (out / "merged" / "model.safetensors.index.json").is_file()
