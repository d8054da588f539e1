"""How a run stops: Ctrl-C and SIGTERM checkpoint and say how to continue (one line, exit 130 /
143); a NaN / inf stops it without writing its result; fp16 overflow steps are skipped and
counted."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, read_metrics, tiny_ckpt  # noqa: F401
from helpers import quiet, train_cfg

import leantune
from leantune.errors import LeantuneError
from leantune.train.checkpoint import latest_checkpoint
from leantune.train.config import TrainConfig
from leantune.train.trainer import Trainer
from leantune.utils.signals import Terminated

SRC = str(Path(leantune.__file__).resolve().parents[1])


def cfg_for(model, data, output, **kw) -> TrainConfig:
    return train_cfg(model, data, output, **{"max_steps": 6, **kw})


def fail_at(trainer, step: int, make):
    """Replace train_step: step `step` (1-based) runs `make(window, real_step)` instead."""
    real, calls = trainer.train_step, []

    def step_fn(window):
        calls.append(1)
        return make(window, real) if len(calls) == step else real(window)

    trainer.train_step = step_fn


def raise_(exc):
    def make(window, real):
        raise exc
    return make


# --- interrupts (in process) ----------------------------------------------------------------------

def test_sigterm_checkpoints_like_ctrl_c(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    cfg = cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run")
    tr = Trainer(cfg, log=quiet)
    fail_at(tr, 4, raise_(Terminated()))
    with pytest.raises(LeantuneError) as e:
        tr.train()
    assert e.value.exit_code == 143
    assert str(e.value) == (f"terminated (SIGTERM) at step 3; checkpoint saved to "
                            f"{tmp_path / 'run' / 'checkpoints' / 'step-00000003'}; continue "
                            "with the same command plus --resume")
    result = Trainer(dataclasses.replace(cfg, resume=True), log=quiet).train()
    assert result.steps == 6 and result.steps_run == 3


def test_interrupt_before_the_first_step_saves_nothing(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    tr = Trainer(cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run"), log=quiet)
    fail_at(tr, 1, raise_(KeyboardInterrupt()))
    with pytest.raises(LeantuneError) as e:
        tr.train()
    assert e.value.exit_code == 130
    assert str(e.value) == ("interrupted (Ctrl-C) before the first step finished; nothing was "
                            "saved; run the command again to start over")
    assert latest_checkpoint(tmp_path / "run") is None


def test_interrupt_before_the_first_resumed_step_keeps_the_checkpoint(tiny_ckpt, alpaca_file,  # noqa: F811
                                                                      tmp_path):
    cfg = cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run", save_every=2)
    tr = Trainer(cfg, log=quiet)
    fail_at(tr, 3, raise_(RuntimeError("crash")))
    with pytest.raises(RuntimeError):
        tr.train()
    tr = Trainer(dataclasses.replace(cfg, resume=True), log=quiet)
    fail_at(tr, 1, raise_(KeyboardInterrupt()))
    with pytest.raises(LeantuneError) as e:
        tr.train()
    assert str(e.value) == ("interrupted (Ctrl-C) before the first step finished; its checkpoint "
                            "at step 2 is unchanged; continue with the same command plus --resume")


def test_resuming_a_finished_run_writes_a_missing_adapter(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """Stopped between the last checkpoint and the adapter (or asked to end at the step it
    reached): --resume writes the final adapter from the checkpoint."""
    cfg = cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run", max_steps=2)
    Trainer(cfg, log=quiet).train()
    adapter = tmp_path / "run" / "adapter_model.safetensors"
    want = adapter.read_bytes()
    adapter.unlink()
    logs = []
    result = Trainer(dataclasses.replace(cfg, resume=True), log=logs.append).train()
    assert result.steps_run == 0 and adapter.read_bytes() == want
    ckpt = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert logs[-1] == f"wrote the final adapter from {ckpt}"


def test_a_second_interrupt_while_saving_is_one_line(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                     monkeypatch):
    import leantune.train.trainer as trainer_mod

    cfg = cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run", save_every=2)
    tr = Trainer(cfg, log=quiet)
    real_save = trainer_mod.save_checkpoint

    def save(output, step, *a, **k):
        if step == 3:  # the interrupt's own checkpoint: Ctrl-C again
            raise KeyboardInterrupt
        return real_save(output, step, *a, **k)

    monkeypatch.setattr(trainer_mod, "save_checkpoint", save)
    fail_at(tr, 4, raise_(KeyboardInterrupt()))
    with pytest.raises(LeantuneError) as e:
        tr.train()
    last = tmp_path / "run" / "checkpoints" / "step-00000002"
    assert e.value.exit_code == 130
    assert str(e.value) == ("interrupted (Ctrl-C) again while saving the checkpoint of step 3, "
                            f"so it was not saved; --resume continues from {last}")
    assert latest_checkpoint(tmp_path / "run") == last


# --- NaN / inf -----------------------------------------------------------------------------------

def nan_loss(window, real):
    loss, gnorm, n = real(window)
    return loss * float("nan"), gnorm, n


@pytest.mark.parametrize("log_every, head", [
    (1, "step 3: the loss is nan and the gradient norm "),
    (2, "steps 3-4: the loss or the gradient norm became NaN or infinite: "),  # read at step 4
])
def test_a_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(
        tiny_ckpt, alpaca_file, tmp_path, log_every, head):  # noqa: F811
    out = tmp_path / "run"
    tr = Trainer(cfg_for(tiny_ckpt, alpaca_file, out, save_every=2, log_every=log_every),
                 log=quiet)
    fail_at(tr, 3, nan_loss)
    with pytest.raises(LeantuneError) as e:
        tr.train()
    msg = str(e.value)
    assert msg.startswith(head)
    assert (f"training diverged and stopped, and no final adapter was written (the last good "
            f"checkpoint {out / 'checkpoints' / 'step-00000002'} is kept); try a lower --lr "
            "(now 0.001) or a lower --max-grad-norm (now 1.0), in a new run (--overwrite)") in msg
    assert latest_checkpoint(out).name == "step-00000002"
    assert not (out / "adapter_model.safetensors").exists()
    assert read_metrics(out)[-1]["step"] == (3 if log_every == 1 else 4)


def test_an_infinite_gradient_without_clipping_says_to_clip(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    def inf_grad(window, real):
        loss, gnorm, n = real(window)
        return loss, gnorm * float("inf"), n

    tr = Trainer(cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run", max_grad_norm=0.0),
                 log=quiet)
    fail_at(tr, 2, inf_grad)
    with pytest.raises(LeantuneError, match=r"step 2: the loss is \S+ and the gradient norm inf"
                                            r".*no checkpoint was written.*try a lower --lr .*or "
                                            r"gradient clipping, --max-grad-norm 1.0"):
        tr.train()


def test_fp16_overflow_steps_are_skipped_and_counted(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                     capsys):
    """The loss scaler skips a step whose gradients overflow, by design: counted, not fatal."""
    cfg = cfg_for(tiny_ckpt, alpaca_file, tmp_path / "run", dtype="float16", max_steps=3)
    tr = Trainer(cfg, log=quiet)
    param = tr.params[0]

    def overflow(window, real):
        handle = param.register_hook(lambda g: g * float("inf"))
        try:
            return real(window)
        finally:
            handle.remove()

    fail_at(tr, 2, overflow)
    scale = tr.scaler.get_scale()
    result = tr.train()
    assert result.steps == 3 and result.skipped_steps == 1
    assert tr.scaler.get_scale() < scale  # the scaler backed off
    assert [r["skipped_steps"] for r in read_metrics(cfg.output) if "loss" in r] == [0, 1, 1]
    assert "the fp16 loss scaler skipped 1 of 3 updates" in capsys.readouterr().out


# --- real signals to a real process ---------------------------------------------------------------

def _spawn(args, cwd):
    env = dict(os.environ, PYTHONPATH=SRC, PYTHONUNBUFFERED="1")
    return subprocess.Popen([sys.executable, "-m", "leantune", *map(str, args)], cwd=cwd,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(proc, text: str, timeout: float = 300) -> list[str]:
    """Read stdout lines until one contains `text`."""
    lines, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if text in line:
            return lines
    proc.kill()
    pytest.fail(f"no {text!r} in the output: {''.join(lines)}{proc.stderr.read()}")


def _one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_sigterm_to_a_running_process(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    args = ["train", "--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
            "--max-steps", 5000, "--max-seq-len", 64, "--batch-size", 1, "--lora-r", 2,
            "--no-progress", "--device", "cpu"]
    proc = _spawn(args, tmp_path)
    _wait_for(proc, "step 1/5000")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err
    line = _one_line(err)
    ckpt = latest_checkpoint(out)
    assert ckpt is not None
    assert line == (f"leantune: error: terminated (SIGTERM) at step {int(ckpt.name[5:])}; "
                    f"checkpoint saved to {ckpt}; continue with the same command plus --resume")


def _torch_loaded(pid: int) -> bool:
    try:
        return "libtorch" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_ctrl_c_during_start_up_and_again(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """Ctrl-C while the process is still loading (torch, the model): one line, exit 130, no
    traceback, and a previous run in --output untouched (the start-up never reached it)."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text("old\n")
    args = ["train", "--model", tiny_ckpt, "--data", alpaca_file, "--output", out,
            "--max-steps", 5, "--device", "cpu", "--overwrite"]
    proc = _spawn(args, tmp_path)
    end = time.monotonic() + 120
    while not _torch_loaded(proc.pid) and proc.poll() is None and time.monotonic() < end:
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # impatient: again
    _, err = proc.communicate(timeout=300)
    # the shell's 130 either way: exit(130), or killed by a Ctrl-C that lands after Python has
    # put back the default handler while shutting down
    assert proc.returncode in (130, -signal.SIGINT), err
    assert _one_line(err) == "leantune: interrupted (Ctrl-C); nothing was written"
    assert (out / "metrics.jsonl").read_text() == "old\n"
    assert sorted(p.name for p in out.iterdir()) == ["metrics.jsonl"]
