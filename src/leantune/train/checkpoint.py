"""Training checkpoints, written atomically, that `--resume` continues from exactly.

OUTPUT/checkpoints/step-00000100/
    trainable.safetensors   trainable parameters by name (LoRA adapters, or all for --full)
    optimizer.pt            optimizer state
    state.json              step, data position, fp16 loss scale (if any), config snapshot
    rng.pt                  torch (CPU and CUDA) and Python RNG states
The folder is written as a hidden temporary folder and renamed into place when complete, so a
crash never leaves a half-written checkpoint that `--resume` would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from ..errors import LeantuneError
from ..utils.io import atomic_write_json

CKPT_DIR = "checkpoints"


def _rng_state() -> dict:
    st = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def _set_rng_state(st: dict) -> None:
    torch.set_rng_state(st["torch"])
    random.setstate(st["python"])
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])


def save_checkpoint(output: Path, step: int, model, optimizer, state: dict, keep: int = 2) -> Path:
    from safetensors.torch import save_file

    root = output / CKPT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    params = {n: p.detach().cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}
    save_file(params, str(tmp / "trainable.safetensors"))
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    torch.save(_rng_state(), tmp / "rng.pt")
    atomic_write_json(tmp / "state.json", dict(state, step=step))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output: Path) -> Path | None:
    ckpts = sorted((output / CKPT_DIR).glob("step-*")) if (output / CKPT_DIR).exists() else []
    return ckpts[-1] if ckpts else None


@torch.no_grad()
def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore parameters, optimizer and RNG from `path`; returns state.json's dict."""
    from safetensors.torch import load_file

    try:
        state = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "trainable.safetensors"))
        opt_state = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=False)
        rng_state = torch.load(path / "rng.pt", weights_only=False)
    except Exception as e:
        raise LeantuneError(f"{path}: checkpoint is unreadable ({type(e).__name__}); delete it "
                            "to resume from the one before") from None
    same = "resume with the same model and LoRA settings"
    params = dict(model.named_parameters())
    for n, t in tensors.items():
        if n not in params:
            raise LeantuneError(f"{path}: parameter {n} is not in the model; {same}")
        if params[n].shape != t.shape:
            raise LeantuneError(f"{path}: parameter {n} has shape {tuple(t.shape)} in the "
                                f"checkpoint but {tuple(params[n].shape)} here; {same}")
    missing = sorted(n for n, p in params.items() if p.requires_grad and n not in tensors)
    if missing:
        raise LeantuneError(f"{path}: {len(missing)} trainable parameters are not in the "
                            f"checkpoint (e.g. {missing[0]}); {same}")
    for n, t in tensors.items():
        params[n].copy_(t)
    try:
        optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise LeantuneError(f"{path}: the optimizer state does not match this run "
                            f"({str(e)[:120]}); {same}") from None
    _set_rng_state(rng_state)
    return state
