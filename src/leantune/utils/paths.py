"""Checks on an output path before anything is written to it."""

from __future__ import annotations

from pathlib import Path

from ..errors import LeantuneError


def check_output_folder(output: Path, inputs: dict[str, Path | None],
                        may_lie_inside: tuple[str, ...] = ()) -> None:
    """`output` must be a folder or not exist yet, and must not be, contain or lie inside one of
    the `inputs` folders ({"model": path, ...}): writing there could replace the files the run
    reads (a model's shards, an adapter). It may lie inside those named in `may_lie_inside` (a
    subfolder of their own is written without touching their files)."""
    output = Path(output)
    if output.exists() and not output.is_dir():
        raise LeantuneError(f"--output {output} is a file; give a folder (it is created if "
                            "missing)")
    out = output.resolve()
    for what, folder in inputs.items():
        if folder is None:
            continue
        src = Path(folder).resolve()
        where = ("is" if out == src else
                 "lies inside" if src in out.parents and what not in may_lie_inside else
                 "contains" if out in src.parents else None)
        if where:
            raise LeantuneError(f"--output {output} {where} the {what} folder {folder}; write to "
                                "a folder of its own, outside it")
