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
from ..utils.io import atomic_write_json, fsync_dir, refuse_links, remove, replace

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
    known = {n for g in saved_groups for n in g["params"]}
    stray = sorted(set(per_param) - known)
    if stray:
        raise LeantuneError(f"{where}: optimizer.safetensors holds state for {stray[0]}, which "
                            "no parameter group of optimizer.json names; the checkpoint is "
                            "corrupt: delete it to resume from the one before")
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
                _check_optimizer_tensors(where, name, per_param[name], _full_shape(p))
                state[i] = {k: like_param(v, p) for k, v in per_param[name].items()}
        hyper = {k: tuple(v) if isinstance(v, list) else v for k, v in saved_group.items()
                 if k != "params"}
        groups.append({**hyper, "params": indices})
        index += len(mine)
    return {"state": state, "param_groups": groups}


CORRUPT = "the checkpoint is corrupt or was edited: delete it to resume from the one before"
ADAM_STATE = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # shaped like their parameter


def _full_shape(p) -> tuple:
    """The whole parameter's shape (FSDP2: of the DTensor, not this process's shard)."""
    return tuple(p.shape)


def _check_optimizer_tensors(where: Path, name: str, saved: dict, shape: tuple) -> None:
    """AdamW state of parameter `name` (whole shape `shape`): the moments shaped like it, the
    step count one finite non-negative number."""
    for key, t in saved.items():
        if key in ADAM_STATE:
            if tuple(t.shape) != shape or not t.is_floating_point():
                raise LeantuneError(f"{where}: optimizer state {name}.{key} has shape "
                                    f"{tuple(t.shape)} ({t.dtype}), the parameter {shape}; "
                                    f"{CORRUPT}")
        elif key == "step":
            if t.numel() != 1 or not bool(torch.isfinite(t.float()).all()) or float(t) < 0:
                raise LeantuneError(f"{where}: optimizer state {name}.step is not one "
                                    f"non-negative number (shape {tuple(t.shape)}); {CORRUPT}")
        else:
            raise LeantuneError(f"{where}: optimizer state {name}.{key} is not AdamW state; "
                                f"{CORRUPT}")


def _check_rng(where: Path, st: dict) -> None:
    """RNG state that this torch and Python take (tried on scratch generators, so a bad one
    changes nothing): one line instead of their tracebacks."""
    t = st["torch"]
    mine = torch.get_rng_state()
    if t.dtype != torch.uint8 or tuple(t.shape) != tuple(mine.shape):
        raise LeantuneError(f"{where}: rng.safetensors: the torch RNG state has shape "
                            f"{tuple(t.shape)} ({t.dtype}), torch needs {tuple(mine.shape)} "
                            f"(uint8); {CORRUPT}")
    try:
        torch.Generator().set_state(t)
        random.Random().setstate(st["python"])
    except (RuntimeError, ValueError, TypeError, OverflowError) as e:
        raise LeantuneError(f"{where}: rng.safetensors: the RNG state does not fit "
                            f"({' '.join(str(e).split())[:100]}); {CORRUPT}") from None
    for i, c in enumerate(st.get("cuda", [])):
        if c.dtype != torch.uint8 or c.dim() != 1:
            raise LeantuneError(f"{where}: rng.safetensors: CUDA RNG state {i} has shape "
                                f"{tuple(c.shape)} ({c.dtype}); {CORRUPT}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# state.json: key -> (what it must be, check); `step` and `data` always, the others where given
_STATE_FIELDS = {
    "step": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    # (the loader's own state: its load_state_dict checks the rest, as it knows its fields)
    "data": ("an object whose epoch and batch_index, where given, are integers >= 0",
             lambda v: isinstance(v, dict) and all(_is_int(v[k]) and v[k] >= 0
                                                   for k in ("epoch", "batch_index") if k in v)),
    "total_steps": ("a positive integer", lambda v: _is_int(v) and v >= 1),
    "tokens_seen": ("a non-negative integer", lambda v: _is_int(v) and v >= 0),
    "first_eval_loss": ("a number or null",
                        lambda v: v is None or (isinstance(v, (int, float))
                                                and not isinstance(v, bool))),
    "scaler": ("an object or null", lambda v: v is None or isinstance(v, dict)),
    "config": ("an object", lambda v: isinstance(v, dict)),
}
def read_state(path: Path, required: tuple = ("step",)) -> dict:
    """state.json of checkpoint `path`, checked: the `required` keys there, every field of the
    right type and range, and the step the one the folder is named for (step-00000012: 12).
    One line otherwise; a checkpoint that fails is never used (a step of -1 would drop the
    whole metrics history)."""
    f = path / "state.json"
    try:
        state = json.loads(f.read_text())
    except FileNotFoundError:
        raise LeantuneError(f"{f}: not found; {CORRUPT}") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise LeantuneError(f"{f}: not valid JSON ({type(e).__name__}); {CORRUPT}") from None
    if not isinstance(state, dict):
        raise LeantuneError(f"{f}: expected a JSON object, got {type(state).__name__}; {CORRUPT}")
    for key in required:
        if key not in state:
            raise LeantuneError(f"{f}: the key {key!r} is missing; {CORRUPT}")
    for key, (what, ok) in _STATE_FIELDS.items():
        if key in state and not ok(state[key]):
            raise LeantuneError(f"{f}: {key} is {json.dumps(state[key])[:60]}, expected {what}; "
                                f"{CORRUPT}")
    named = path.name[len("step-"):] if path.name.startswith("step-") else None
    if named is not None and named.isdigit() and int(named) != state["step"]:
        raise LeantuneError(f"{f}: step is {state['step']}, but the folder is {path.name}; "
                            f"{CORRUPT}")
    return state


# Settings that change what the remaining steps compute (or the shapes being trained): a
# --resume with other values would not continue the run, and is refused before the weights load.
# (--max-steps / --epochs may change: that extends or shortens the run; the data, batch size,
# max_seq_len and seed are checked by the data loader.)
RESUME_MUST_MATCH = ("grad_accum", "lr", "weight_decay", "warmup_steps", "schedule",
                     "max_grad_norm", "dtype", "train_on_inputs", "router_aux_loss_coef",
                     "load_in_4bit", "full", "lora_alpha", "use_rslora", "adapter", "precision")
# (--lora-r and --lora-targets change the shapes: the checkpoint loader names the parameter)


def _comparable(value):
    return json.loads(json.dumps(value))


def check_resume_settings(ckpt: Path, cfg) -> dict:
    """Refuse a --resume whose settings differ from those checkpoint `ckpt` was written with
    (its state.json, checked: `read_state`); reads no tensor, so it runs before the weights
    load. Returns the state."""
    state = read_state(ckpt, required=("step", "data"))
    for key in ("epoch", "batch_index"):  # (what the trainer resumes the data loader from)
        if key not in state["data"]:
            raise LeantuneError(f"{ckpt / 'state.json'}: data has no {key!r}; {CORRUPT}")
    check_resumed_config(ckpt, state.get("config") or {}, cfg)
    return state


def check_resumed_config(ckpt: Path, saved: dict, cfg) -> None:
    """`saved`: the checkpoint's config (nested, or flat as runs before the sections wrote it:
    those trained SFT with the default objective). Each RESUME_MUST_MATCH setting it records,
    and the objective with its settings, must equal `cfg`'s: one line naming the flag if not."""
    from dataclasses import fields

    from .config import FLAT_KEYS, FLAT_NAMES, TrainConfig

    was = TrainConfig.from_dict(saved)

    def recorded(key):  # a setting the checkpoint's config holds (flat or in its section)
        if key in FLAT_KEYS:
            section, name = FLAT_KEYS[key]
            return key in saved or name in (saved.get(section) or {})
        return key in saved

    keys = [k for k in RESUME_MUST_MATCH if recorded(k)]
    keys += [FLAT_NAMES[("objective", f.name)] for f in fields(was.objective)]
    for key in keys:
        if _comparable(was.get(key)) != _comparable(cfg.get(key)):
            flag = "--" + key.replace("_", "-")
            raise LeantuneError(
                f"{ckpt}: the run was started with {flag} {was.get(key)}, this command has "
                f"{cfg.get(key)}; resume with the same value (or start a new run in "
                "another --output)")


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
        remove(final)
    replace(tmp, final)
    fsync_dir(root)
    for old in sorted(root.glob("step-*"))[:-keep] if keep > 0 else []:
        remove(old)
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
    state = read_state(path)
    try:
        tensors = load_file(str(path / "trainable.safetensors"))
        saved_optimizer = _read_optimizer(path)
        rng_state = _load_rng(path / "rng.safetensors")
    except Exception as e:
        raise LeantuneError(f"{path}: checkpoint is unreadable ({type(e).__name__}); delete it "
                            "to resume from the one before") from None
    _check_rng(path, rng_state)
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
