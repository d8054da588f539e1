"""Files leantune writes get the mode a new file gets (0o666 less the umask), also where a
library writes the temporary file by its own rename (safetensors' save_file writes 0o600):
an export must be readable by another user, e.g. the server that loads it."""

import os
import stat

import torch

from leantune.utils.io import atomic_path, atomic_write_text


def test_written_files_take_the_umask_mode(tmp_path):
    from safetensors.torch import save_file

    old = os.umask(0o022)
    try:
        with atomic_path(tmp_path / "model.safetensors") as tmp:
            save_file({"w": torch.zeros(2)}, str(tmp))
        atomic_write_text(tmp_path / "config.json", "{}")
        os.umask(0o027)
        atomic_write_text(tmp_path / "other.json", "{}")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"model.safetensors": 0o644, "config.json": 0o644, "other.json": 0o640}
