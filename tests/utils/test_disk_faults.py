"""Disk faults end in one line naming the path, exit code 2, nothing lost: a full disk, a
read-only output folder, an --output under a file, a closed stdout pipe. The output folder is
probed before the weights load, so these fail in a second.

Tests run as root, for whom chmod blocks nothing, so a read-only or full disk is simulated at
the system-call boundary: os.open / os.write raise the errno the kernel would, for paths inside
one folder only.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, cli_error, run_cli, tiny_ckpt  # noqa: F401

import leantune.train.trainer as trainer_mod
from leantune.utils.paths import disk_error_message, os_error_of, probe_writable

FAST = ["--max-seq-len", "128", "--batch-size", "4", "--lora-r", "4", "--no-progress",
        "--device", "cpu"]


def train_args(model, data, output, *extra):
    return ["train", "--model", model, "--data", data, "--output", output, "--max-steps", 2,
            *FAST, *extra]


@pytest.fixture
def no_weights(monkeypatch):
    """The weight loader fails the test if it is called: the check must come before it."""
    def load_model(*_a, **_k):
        raise AssertionError("the weights were loaded before the disk fault was found")

    monkeypatch.setattr(trainer_mod, "load_model", load_model)


def refuse_writes(monkeypatch, folder: Path, code: int) -> None:
    """Files created inside `folder` fail with `code`, as the kernel does on a read-only
    filesystem (EROFS) or a full disk (ENOSPC: creating works, writing does not)."""
    real_open, real_write = os.open, os.write
    inside, fds = str(folder.resolve()), set()

    def fake_open(path, flags, *a, **k):
        creates = flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        here = os.path.abspath(os.fspath(path)).startswith(inside)
        if here and creates and code != errno.ENOSPC:
            raise OSError(code, os.strerror(code), os.fspath(path))
        fd = real_open(path, flags, *a, **k)
        if here and creates:
            fds.add(fd)
        return fd

    def fake_write(fd, data):
        if fd in fds:
            raise OSError(code, os.strerror(code))
        return real_write(fd, data)

    monkeypatch.setattr(os, "open", fake_open)
    monkeypatch.setattr(os, "write", fake_write)


def test_output_under_a_file_is_one_line_before_the_weights(tiny_ckpt, alpaca_file, tmp_path,  # noqa: F811
                                                           capsys, no_weights):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("keep me")
    msg = cli_error(capsys, *train_args(tiny_ckpt, alpaca_file, blocker / "run"))
    assert f"--output {blocker / 'run'}: {blocker} is a file, not a folder" in msg
    assert blocker.read_text() == "keep me"


@pytest.mark.parametrize("code, words", [(errno.EROFS, "read-only"),
                                         (errno.ENOSPC, "the disk is full"),
                                         (errno.EACCES, "permission denied")])
def test_an_unwritable_output_folder_is_one_line_before_the_weights(
        tiny_ckpt, alpaca_file, tmp_path, capsys, monkeypatch, no_weights, code, words):  # noqa: F811
    out = tmp_path / "run"
    out.mkdir()
    (out / "mine.txt").write_text("a file of the user's")
    refuse_writes(monkeypatch, out, code)
    msg = cli_error(capsys, *train_args(tiny_ckpt, alpaca_file, out))
    assert msg.startswith(f"--output {out}: cannot write there: {out}")
    assert words in msg
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"]  # the probe left nothing


def test_a_new_output_folder_is_probed_in_its_nearest_existing_parent(tmp_path, monkeypatch):
    refuse_writes(monkeypatch, tmp_path, errno.EROFS)
    with pytest.raises(Exception, match="read-only") as e:
        probe_writable(tmp_path / "a" / "b")
    assert str(tmp_path) in str(e.value)
    monkeypatch.undo()
    probe_writable(tmp_path / "a" / "b")  # writable: passes, creates nothing
    assert list(tmp_path.iterdir()) == []


def test_a_disk_that_fills_during_the_run_is_one_line_and_keeps_the_previous_run(
        tiny_ckpt, alpaca_file, tmp_path, capsys, monkeypatch):  # noqa: F811
    """ENOSPC while a checkpoint is written (safetensors reports it as its own error, not an
    OSError): one line naming the file; --overwrite's set-aside previous run is put back."""
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "run"
    rc, _, err = run_cli(capsys, *train_args(tiny_ckpt, alpaca_file, out))
    assert rc == 0, err
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}

    def full(tensors, filename, metadata=None):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              f"(os error 28) at path \"{filename}\"")

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    msg = cli_error(capsys, *train_args(tiny_ckpt, alpaca_file, out, "--overwrite"))
    assert "trainable.safetensors: the disk is full (No space left on device)" in msg
    assert str(out) in msg and "the files it had written before are intact" in msg
    after = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert after == before


def test_an_oserror_that_is_no_disk_fault_is_not_dressed_up():
    assert disk_error_message(OSError(errno.EINVAL, "Invalid argument")) is None
    assert os_error_of(ValueError("x")) is None
    msg = disk_error_message(OSError(errno.EROFS, os.strerror(errno.EROFS), "/mnt/x"))
    assert msg.startswith("/mnt/x: the filesystem is read-only")


def test_a_real_safetensors_write_error_carries_its_errno(tmp_path):
    from safetensors.torch import save_file
    import torch

    with pytest.raises(Exception) as e:
        save_file({"a": torch.zeros(2)}, str(tmp_path / "missing" / "x.safetensors"))
    err = os_error_of(e.value)
    assert err.errno == errno.ENOENT and str(tmp_path / "missing") in err.filename


def test_a_closed_stdout_pipe_is_one_line(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    """`leantune train ... | head -1`: the reader goes away after the first line."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(Path(trainer_mod.__file__).parents[2])}
    p = subprocess.Popen([sys.executable, "-m", "leantune", *map(str, train_args(
        tiny_ckpt, alpaca_file, out, "--max-steps", 40))], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env=env, text=True)
    p.stdout.readline()
    p.stdout.close()  # as `head -1` exits
    err = p.stderr.read()
    assert p.wait(timeout=300) == 2, err
    assert "Traceback" not in err and "Exception ignored" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("leantune: error: stdout was closed"), err
