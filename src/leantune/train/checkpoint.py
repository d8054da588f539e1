"""Training checkpoints, written atomically, that `--resume` continues from exactly.

OUTPUT/checkpoints/step-00000100/
    trainable.safetensors   trainable parameters by name (LoRA adapters, or all for --full)
    optimizer.safetensors   optimizer state tensors, named "<parameter name>.<state key>"
                            (AdamW: exp_avg, exp_avg_sq, step)
    optimizer.json          optimizer hyper-parameters per group, with parameter names
    rng.safetensors         torch CPU and CUDA RNG states; Python's `random` state (metadata)
    state.json              step, data position, fp16 loss scale (if any), config snapshot
Nothing in a checkpoint is a pickle: `--resume` of a folder someone shared runs no code. State
is keyed by parameter name, not by position, so a mismatch is named. Tensors are whole (FSDP2's
shards gathered) and the data position counts global batches, so a run resumes on any number of
processes that keeps its global batch (under torchrun rank 0 writes). The folder is written as a
hidden temporary folder and renamed into place when complete, so a crash never leaves a
half-written checkpoint that `--resume` would pick up.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch

from ..dist.tensors import copy_full_into, full_tensor, like_param
from ..errors import LeantuneError
from ..utils.io import atomic_write_json, refuse_links

CKPT_DIR = "checkpoints"
PICKLED = ("optimizer.pt", "rng.pt")  # what leantune 0.1 wrote; never loaded


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


def _save_rng(path: Path) -> None:
    from safetensors.torch import save_file

    st = _rng_state()
    tensors = {"torch": st["torch"]}
    tensors.update({f"cuda.{i}": s for i, s in enumerate(st.get("cuda", []))})
    save_file(tensors, str(path), metadata={"python": json.dumps(st["python"])})


def _load_rng(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        version, internal, gauss = json.loads(f.metadata()["python"])
        cuda = sorted((k for k in f.keys() if k.startswith("cuda.")),  # noqa: SIM118
                      key=lambda k: int(k.split(".")[1]))
        st = {"torch": f.get_tensor("torch"), "python": (version, tuple(internal), gauss)}
        if cuda:
            st["cuda"] = [f.get_tensor(k) for k in cuda]
    return st


def _whole(t: torch.Tensor, keep: bool) -> torch.Tensor | None:
    """`t` whole (gathered from every process where it is sharded: all of them call this, in
    the same order), on the CPU where `keep`, else None."""
    t = full_tensor(t.detach())
    return t.cpu().contiguous() if keep else None


def _optimizer_state(model, optimizer, keep: bool) -> tuple[dict, list]:
    """Optimizer state tensors by "<parameter name>.<state key>" (whole; only where `keep`),
    and the hyper-parameters of each group with its parameters' names."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors, groups = {}, []
    for group in optimizer.param_groups:
        groups.append({k: v for k, v in group.items() if k != "params"})
        groups[-1]["params"] = [names[id(p)] for p in group["params"]]
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                tensors[f"{names[id(p)]}.{key}"] = _whole(value, keep)
    return tensors, groups


def _read_optimizer(folder: Path) -> tuple[list[dict], dict[str, dict]]:
    """(saved param groups, {parameter name: {state key: tensor}})."""
    from safetensors.torch import load_file

    groups = json.loads((folder / "optimizer.json").read_text())["param_groups"]
    per_param: dict[str, dict] = {}
    for key, t in load_file(str(folder / "optimizer.safetensors")).items():
        name, _, what = key.rpartition(".")
        per_param.setdefault(name, {})[what] = t
    return groups, per_param


def _optimizer_state_dict(saved, model, optimizer, where: Path, same: str) -> dict:
    """The saved optimizer state (from `_read_optimizer`) in `optimizer.state_dict()` form,
    indexed as this optimizer is."""
    saved_groups, per_param = saved
    names = {id(p): n for n, p in model.named_parameters()}
    if len(saved_groups) != len(optimizer.param_groups):
        raise LeantuneError(f"{where}: the optimizer state has {len(saved_groups)} parameter "
                            f"groups, this run {len(optimizer.param_groups)}; {same}")
    state, groups, index = {}, [], 0
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        mine = [names[id(p)] for p in group["params"]]
        if set(mine) != set(saved_group["params"]):
            other = next((n for n in mine if n not in saved_group["params"]),
                         next((n for n in saved_group["params"] if n not in mine), mine[0]))
            raise LeantuneError(f"{where}: the optimizer state does not match this run's "
                                f"parameters (e.g. {other}); {same}")
        indices = list(range(index, index + len(mine)))
        for i, name, p in zip(indices, mine, group["params"]):
            if name in per_param:  # (sharded like the parameter where it is: FSDP2)
                state[i] = {k: like_param(v, p) for k, v in per_param[name].items()}
        hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items()
                 if k != "params"}
        groups.append({**hyper, "params": indices})
        index += len(mine)
    return {"state": state, "param_groups": groups}


def save_checkpoint(output: Path, step: int, model, optimizer, state: dict, keep: int = 2,
                    write: bool = True) -> Path:
    """Write checkpoint `step` (keeping the last `keep`); returns its folder. Sharded tensors
    (FSDP2) are saved whole, so any number of processes resumes from it. Under torchrun every
    process calls this (for the gathers); only rank 0 (`write`) writes."""
    from safetensors.torch import save_file

    root = output / CKPT_DIR
    final = root / f"step-{step:08d}"
    params = {n: _whole(p, write) for n, p in model.named_parameters() if p.requires_grad}
    opt_tensors, opt_groups = _optimizer_state(model, optimizer, write)
    if not write:
        return final
    refuse_links(final, output)  # a linked checkpoints/ or step folder: never written through
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step:08d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(params, str(tmp / "trainable.safetensors"))
    save_file(opt_tensors, str(tmp / "optimizer.safetensors"))
    atomic_write_json(tmp / "optimizer.json", {"param_groups": opt_groups})
    _save_rng(tmp / "rng.safetensors")
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


def refuse_pickled(path: Path) -> None:
    """A checkpoint of leantune 0.1 keeps its optimizer and RNG state as pickles; loading one
    could run code, so it is refused (its weights are still exportable)."""
    pickled = [n for n in PICKLED if (path / n).exists()]
    if pickled and not (path / "optimizer.safetensors").exists():
        raise LeantuneError(
            f"{path}: {pickled[0]} is a pickle (written by an older leantune), and leantune no "
            "longer loads pickles because loading one can run code; start the run again with "
            f"--overwrite, or export its weights with `leantune export --adapter {path}`")


@torch.no_grad()
def load_checkpoint(path: Path, model, optimizer) -> dict:
    """Restore parameters, optimizer and RNG from `path`; returns state.json's dict."""
    from safetensors.torch import load_file

    refuse_pickled(path)
    same = "resume with the same model and LoRA settings"
    try:
        state = json.loads((path / "state.json").read_text())
        tensors = load_file(str(path / "trainable.safetensors"))
        saved_optimizer = _read_optimizer(path)
        rng_state = _load_rng(path / "rng.safetensors")
    except Exception as e:
        raise LeantuneError(f"{path}: checkpoint is unreadable ({type(e).__name__}); delete it "
                            "to resume from the one before") from None
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
    opt_state = _optimizer_state_dict(saved_optimizer, model, optimizer, path, same)
    for n, t in tensors.items():
        copy_full_into(params[n], t)  # (FSDP2: this process's rows)
    try:
        optimizer.load_state_dict(opt_state)
    except (ValueError, KeyError, RuntimeError) as e:
        raise LeantuneError(f"{path}: the optimizer state does not match this run "
                            f"({str(e)[:120]}); {same}") from None
    _set_rng_state(rng_state)
    return state
