"""Is this the base an adapter was trained on?

An adapter fits any base of the same shapes, so merging it onto another model of one family
(another size of fine-tune, a base instead of its instruct model) gives a broken model without a
word. At training, leantune records a *fingerprint* of the base's weights: the adapter's
safetensors metadata (`leantune.base_fingerprint`, beside `leantune.base_model`) and
run_config.json / every checkpoint's state.json (`base_fingerprint`); adapter_config.json names
the base (`base_model_name_or_path`, PEFT's field).

`check_base` compares a base folder with what an adapter recorded: by fingerprint where one is
recorded (a copy of the base in another folder passes), else by name (the same path, the same hub
id, or a hub-cache snapshot of it). A different base is refused in one line; with
`force=True` (--force-base) it is a one-line warning instead.

The fingerprint reads only the safetensors headers and 3 x 32 bytes of each tensor (its start,
middle and end), so it costs milliseconds even for a 70B checkpoint, and it does not depend on
how the tensors are split into shards: sha256 over, for every tensor in name order, its name,
dtype, shape and those bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from pathlib import Path

from ..errors import LeantuneError

FINGERPRINT_KEY = "leantune.base_fingerprint"  # in the adapter's safetensors metadata
BASE_NAME_KEY = "leantune.base_model"
VERSION = "v1"
WINDOW = 32  # bytes sampled at each of a tensor's start, middle and end
MAX_HEADER = 100 << 20


def _header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (tensor name -> {dtype, shape, data_offsets}) and where its
    data starts."""
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            (n,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
            if not 0 < n <= MAX_HEADER:
                raise ValueError("bad header length")
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        raise LeantuneError(f"{path}: unreadable safetensors file ({type(e).__name__}); "
                            "re-download or re-export it") from None
    if not isinstance(header, dict):
        raise LeantuneError(f"{path}: unreadable safetensors header; re-download it")
    header.pop("__metadata__", None)
    return header, 8 + n


def fingerprint(folder: str | os.PathLike) -> str:
    """The fingerprint of the weights in checkpoint `folder` (module docstring):
    "v1:" + 32 hex digits."""
    from ..model.loader import safetensors_files

    entries = []
    for path in safetensors_files(Path(folder)):
        header, start = _header(path)
        for name, info in header.items():
            entries.append((name, info, path, start))
    h = hashlib.sha256(VERSION.encode())
    entries.sort(key=lambda e: e[0])
    handles: dict[Path, object] = {}
    try:
        for name, info, path, start in entries:
            try:
                begin, end = (int(x) for x in info["data_offsets"])
                h.update(json.dumps([name, info["dtype"], list(info["shape"])]).encode())
            except (KeyError, TypeError, ValueError):
                raise LeantuneError(f"{path}: tensor {name} has an unreadable header entry; "
                                    "re-download the model") from None
            f = handles.get(path) or handles.setdefault(path, open(path, "rb"))
            size = end - begin
            spans = ([(0, size)] if size <= 3 * WINDOW else
                     [(0, WINDOW), (size // 2 - WINDOW // 2, WINDOW), (size - WINDOW, WINDOW)])
            for off, n in spans:
                f.seek(start + begin + off)
                h.update(f.read(n))
    finally:
        for f in handles.values():
            f.close()
    return f"{VERSION}:{h.hexdigest()[:32]}"


def model_fingerprint(model) -> str | None:
    """The fingerprint of the checkpoint a leantune model was loaded from (its source_path),
    computed once per model; None for a model built in memory."""
    cached = getattr(model, "_base_fingerprint", None)
    if cached is not None:
        return cached
    source = getattr(model, "source_path", None)
    if source is None or not Path(source).is_dir():
        return None
    fp = fingerprint(source)
    try:
        model._base_fingerprint = fp
    except AttributeError:
        pass
    return fp


def recorded_base(weights: Path) -> tuple[str | None, str | None]:
    """(base name, fingerprint) an adapter recorded, from its weights file `weights`
    (adapter_model.safetensors or a checkpoint's trainable.safetensors) and the files beside it:
    the safetensors metadata, adapter_config.json, state.json or run_config.json."""
    name = fp = None
    try:
        from safetensors import safe_open

        with safe_open(str(weights), framework="pt", device="cpu") as sf:
            meta = sf.metadata() or {}
        fp, name = meta.get(FINGERPRINT_KEY), meta.get(BASE_NAME_KEY)
    except Exception:  # unreadable weights: attach_adapter says so, in its own line
        pass
    folder = weights.parent
    for file, get_name in (("adapter_config.json", lambda d: d.get("base_model_name_or_path")),
                           ("state.json", lambda d: (d.get("config") or {}).get("model")),
                           ("run_config.json", lambda d: (d.get("config") or {}).get("model"))):
        path = folder / file
        if not path.is_file():
            continue
        try:
            d = json.loads(path.read_text())
            name = name or get_name(d)
            fp = fp or d.get("base_fingerprint")
        except (ValueError, AttributeError):
            continue
    return (str(name) if name else None), (str(fp) if fp else None)


def base_name_to_record(model: str | os.PathLike | None) -> str | None:
    """The base name an adapter records (PEFT's base_model_name_or_path): a local folder as its
    absolute path, so the adapter finds its base from any working directory; a hub id as given."""
    if not isinstance(model, (str, os.PathLike)):  # (None: a model passed in as an object)
        return model
    p = Path(model).expanduser()
    try:
        if p.is_dir():
            return str(p.resolve())
    except OSError:
        pass
    return str(model)


def _same_name(recorded: str, given: str, folder: Path) -> bool:
    """Whether base name `recorded` (a path or hub id) names `folder` (given as `given`)."""
    if recorded == given:
        return True
    p = Path(recorded).expanduser()
    try:
        if p.is_dir() and p.resolve() == folder.resolve():
            return True
    except OSError:
        pass
    # a hub id's snapshot in the huggingface_hub cache: .../models--org--name/snapshots/<rev>
    cache = "models--" + recorded.replace("/", "--")
    return bool(re.fullmatch(r"[\w.-]+(/[\w.-]+)?", recorded)) and cache in folder.parts


def check_base(weights: Path, given: str, folder: Path, *, force: bool = False,
               log=print) -> None:
    """Refuse (or, with `force`, warn about) base `folder` (--model `given`) when it is not the
    one the adapter whose weights file is `weights` recorded (module docstring)."""
    name, recorded_fp = recorded_base(Path(weights))
    adapter = Path(weights).parent
    if recorded_fp is not None:
        actual = fingerprint(folder)
        if actual == recorded_fp:
            return
        problem = (f"{adapter}: the adapter was trained on {name or 'another base'} (weights "
                   f"fingerprint {recorded_fp}), but --model {given} has other weights "
                   f"({actual})")
    elif name is not None:
        if _same_name(name, given, folder):
            return
        problem = (f"{adapter}: the adapter was trained on {name} (adapter_config.json's "
                   f"base_model_name_or_path), not --model {given}")
    else:
        return  # nothing recorded: nothing to check against
    if force:
        log(f"leantune: warning: {problem}; going on (--force-base)")
        return
    raise LeantuneError(f"{problem}; give the base it was trained on, or --force-base to use "
                        "this one anyway")


def check_adapter_base(adapter: str | os.PathLike, model: str, *, force: bool = False,
                       log=print, merge_onto: str | None = None) -> None:
    """`check_base` for the command line's --adapter and --model (a folder or hub id): the
    adapter's weights file found as merge and generate find it (an adapter folder, a run
    folder's latest checkpoint, one checkpoint). With `merge_onto` (export --merge-onto) and a
    --model that is not 4-bit, nothing is checked: the export refuses that pair in its own
    words."""
    from ..export.merge import adapter_source
    from ..model.loader import bnb_quant_states, resolve_checkpoint, safetensors_files

    _, weights = adapter_source(Path(adapter), log=lambda _: None)
    folder = resolve_checkpoint(model)
    if merge_onto and not bnb_quant_states(safetensors_files(folder)):
        return
    check_base(weights, str(model), folder, force=force, log=log)
