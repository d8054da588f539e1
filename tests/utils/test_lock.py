"""One run per folder: a second process writing into a folder another one holds is refused in
one line naming the holder's PID; the OS frees the lock when the holder dies (even SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import one_torch_thread  # noqa: F401  (autouse)
from helpers import alpaca_file, tiny_ckpt  # noqa: F401
from helpers import quiet, save_random_adapter, train_cfg

import leantune
from leantune.errors import LeantuneError
from leantune.utils import lock

SRC = str(Path(leantune.__file__).resolve().parents[1])

HOLDER = textwrap.dedent("""
    import sys
    from leantune.utils import lock
    if sys.argv[1] == "lock_run":
        lock.lock_run(sys.argv[2])
    else:
        held = lock.lock_beside(sys.argv[2])
        held.__enter__()
    print("locked", flush=True)
    sys.stdin.read()
""")


def hold(how: str, folder: Path) -> subprocess.Popen:
    """A second real process that locks `folder` (lock_run / lock_beside) and waits."""
    env = dict(os.environ, PYTHONPATH=SRC)
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, how, str(folder)], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def one_line(stderr: str) -> str:
    assert "Traceback" not in stderr, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    return lines[0]


def test_a_second_train_into_a_held_folder_is_refused(tiny_ckpt, alpaca_file, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    holder = hold("lock_run", out)
    try:
        env = dict(os.environ, PYTHONPATH=SRC)
        res = subprocess.run([sys.executable, "-m", "leantune", "train", "--model", tiny_ckpt,
                              "--data", alpaca_file, "--output", out, "--max-steps", "1",
                              "--device", "cpu", "--no-progress"], env=env,
                             capture_output=True, text=True, timeout=600)
        assert res.returncode == 2, res.stderr
        assert one_line(res.stderr) == (
            f"leantune: error: {out}: this output folder is in use by another leantune process "
            f"(PID {holder.pid}, lock {lock.lock_path(out)}); wait for it to end, or choose "
            "another --output")
        assert not out.exists()  # nothing written
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # the holder died without cleaning up: its lock went with it, the stale file is reused
    assert lock.lock_path(out).exists()
    from leantune.train.trainer import Trainer

    result = Trainer(train_cfg(tiny_ckpt, alpaca_file, out, max_steps=1), log=quiet).train()
    assert result.steps == 1
    assert lock.lock_path(out).read_text().strip() == str(os.getpid())
    lock.release(out)
    assert not lock.lock_path(out).exists()


def test_a_second_export_into_a_held_folder_is_refused(tiny_ckpt, tmp_path):  # noqa: F811
    from leantune.export import export_merged

    out = tmp_path / "merged"
    holder = hold("lock_beside", out)
    try:
        with pytest.raises(LeantuneError, match=rf"{out}: this output folder is in use by "
                                                rf"another leantune process \(PID {holder.pid},"):
            export_merged(tiny_ckpt, None, out)
        assert not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


@pytest.mark.parametrize("fmt", ["gguf", "gguf-lora"])
def test_a_gguf_export_into_a_held_folder_is_refused(fmt, tiny_ckpt, tmp_path):  # noqa: F811
    """GGUF exports take the same lock as the merged export and a run: a second writer into
    the folder (here an export held by another process) is refused before anything is
    written."""
    pytest.importorskip("gguf")
    from leantune.export.gguf.writer import export_gguf, export_gguf_lora

    out = tmp_path / "gguf"
    holder = hold("lock_beside", out)
    try:
        with pytest.raises(LeantuneError, match=rf"{out}: this output folder is in use by "
                                                rf"another leantune process \(PID {holder.pid},"):
            if fmt == "gguf":
                export_gguf(tiny_ckpt, None, out, quant="f16")
            else:
                adapter = tmp_path / "adapter"
                save_random_adapter(tiny_ckpt, adapter, seed=0)
                export_gguf_lora(tiny_ckpt, adapter, out)
        assert not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()


def test_a_lock_creates_no_folder_and_leaves_nothing_when_given_back(tmp_path):
    out = tmp_path / "a" / "b"
    lock.lock_run(out)
    lock.lock_run(out)  # the same process: not a second run
    assert not out.exists()
    lock.release(out)
    assert list((tmp_path / "a").iterdir()) == []


def test_a_linked_lock_file_is_refused(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    lock.lock_path(out).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(LeantuneError, match="is a symbolic link"):
        lock.lock_run(out)
    assert not (tmp_path / "elsewhere").exists()
