"""Where training rows come from: a data file, a dataset folder, or a Hugging Face hub dataset.

`--data` (and `--eval-data`) name one of:

* a local file (.jsonl, .json, .csv, .parquet), read by `leantune.data.files`;
* a local folder, loaded through the `datasets` library: a folder written by ``save_to_disk``, or
  a folder of data files such as a clone of a hub dataset repository;
* ``org/name`` that is not a local path: a dataset on the Hugging Face hub, loaded through
  ``datasets.load_dataset`` (cached after the first download).

An existing local path always wins. ``org/name`` that does not exist locally is a hub dataset,
unless it ends in a data file extension or its first part is a local folder: then it is a local
path with a typo, reported as "not found". The split (``--data-split``, default "train") and the
subset (``--data-subset``, the dataset's config name) pick what is loaded; a ``save_to_disk``
folder of one dataset has neither.

`datasets` is an optional dependency, imported only here and only when needed. Rows from it carry
the location ``"row N"`` under the source label ``org/name[split]``, so errors read
``org/name[train] (row 17): field 'output' is null`` (a dataset's rows share its columns).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from leantune.data.files import SUPPORTED_SUFFIXES, Location, read_rows_located
from leantune.errors import LeantuneError

# org/name as the hub spells dataset ids (one slash; letters, digits, "-", "_", ".").
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
INSTALL = "pip install 'leantune[datasets]'"


def is_hub_dataset(spec: str | os.PathLike) -> bool:
    """True when `spec` names a hub dataset (``org/name``) rather than a local path."""
    s = str(spec)
    if Path(s).exists() or not _HUB_ID.fullmatch(s):
        return False
    if s.lower().endswith(SUPPORTED_SUFFIXES):
        return False  # "data/trian.jsonl": a data file that is not there
    return not Path(s.split("/")[0]).is_dir()  # "data/trian": a missing file in a local folder


def uses_datasets(spec: str | os.PathLike) -> bool:
    """True when `spec` is loaded through the `datasets` library (a folder or a hub dataset)."""
    return Path(spec).is_dir() or is_hub_dataset(spec)


def _import_datasets(spec: str):
    what = "a dataset folder" if Path(spec).is_dir() else "a Hugging Face hub dataset"
    try:
        import datasets
    except ImportError:
        raise LeantuneError(f"{spec}: loading {what} needs the datasets library; run `{INSTALL}` "
                            "(or pass a .jsonl, .json, .csv or .parquet file)") from None
    return datasets


def check_source(spec: str | os.PathLike, flag: str = "--data") -> None:
    """The cheap checks, before a model is loaded: the path exists or names a hub dataset, and
    `datasets` is installed when it is needed."""
    if uses_datasets(spec):
        _import_datasets(str(spec))
    elif not Path(spec).exists():
        raise LeantuneError(f"{spec}: data file not found; check the {flag} path")


def load_rows(spec: str | os.PathLike, split: str = "train", subset: str | None = None, *,
              split_flag: str = "--data-split") -> tuple[str, list[tuple[Location, dict]]]:
    """Read the rows `spec` names (see the module docstring).

    Args:
        spec: a data file, a dataset folder or a hub dataset id.
        split, subset: what to load from a dataset folder or hub dataset (files have neither).
        split_flag: the flag that sets `split`, named in the error for a missing split.

    Returns:
        (source label for messages, ``[(location, row), ...]``).
    Raises:
        LeantuneError: one line naming the file, folder or dataset and what to do.
    """
    if uses_datasets(spec):
        return read_dataset_rows(str(spec), split, subset, split_flag=split_flag)
    return str(spec), read_rows_located(spec)


def _text(exc: Exception) -> str:
    """An exception's message on one line (the `datasets` messages list the valid choices)."""
    return " ".join(str(exc).split())[:300].rstrip(".")


def _saved_to_disk(folder: Path) -> bool:
    """A folder written by `Dataset.save_to_disk` / `DatasetDict.save_to_disk`."""
    return (folder / "state.json").is_file() or (folder / "dataset_dict.json").is_file()


def read_dataset_rows(spec: str, split: str = "train", subset: str | None = None, *,
                      split_flag: str = "--data-split") -> tuple[str, list[tuple[Location, dict]]]:
    """Load `split` of a dataset folder or hub dataset through the `datasets` library."""
    datasets = _import_datasets(spec)
    label = f"{spec}[{split}]" if subset is None else f"{spec}:{subset}[{split}]"
    try:
        if _saved_to_disk(Path(spec)):
            ds = datasets.load_from_disk(spec)
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise LeantuneError(f"{spec}: the saved dataset has no split {split!r} (it has "
                                        f"{', '.join(ds)}); pass {split_flag} with one of them")
                ds = ds[split]
            else:
                label = spec  # one saved dataset: no splits, no subsets
        else:
            ds = datasets.load_dataset(spec, name=subset, split=split)
    except LeantuneError:
        raise
    except ConnectionError as e:  # offline, or the hub is unreachable
        raise LeantuneError(
            f"{spec}: no local file or folder of that name, and the Hugging Face hub cannot be "
            f"reached to load it as a dataset ({_text(e)}); check the path, or the network "
            "(a hub dataset loaded once is cached and then loads offline)") from None
    except FileNotFoundError as e:  # datasets' DatasetNotFoundError is one
        if Path(spec).is_dir():
            raise LeantuneError(f"{spec}: the folder holds no data files the datasets library "
                                "reads; pass a data file instead, or a folder of them") from None
        raise LeantuneError(f"{spec}: no local file or folder of that name, and no such dataset on "
                            f"the Hugging Face hub ({_text(e)}); check the path or the id (a "
                            "private or gated dataset needs HF_TOKEN)") from None
    except ValueError as e:  # an unknown split or config name: the message lists the valid ones
        text = _text(e)
        if "split" in text.lower():
            raise LeantuneError(f"{label}: {text}; pass {split_flag} with one of them") from None
        if "config" in text.lower():
            raise LeantuneError(f"{spec}: {text}; pass --data-subset with one of them") from None
        raise LeantuneError(f"{label}: cannot load the dataset ({text})") from None
    except Exception as e:  # datasets and its file readers raise many unrelated types
        raise LeantuneError(
            f"{label}: cannot load the dataset ({type(e).__name__}: {_text(e)})") from None
    rows = [(f"row {i}", dict(row)) for i, row in enumerate(ds, start=1)]
    if not rows:
        raise LeantuneError(f"{label}: the dataset has no rows; pick another split or dataset")
    return label, rows
