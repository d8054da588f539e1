"""A run's output folder: what marks a previous run, and replacing one (--overwrite) without
losing it before the new run has something to show.

--overwrite moves the previous run's files into OUTPUT/.leantune-previous-run (renames: no copy,
nothing deleted) when the new run starts. They are deleted once the new run has written its first
checkpoint, and put back if it fails or is stopped before that. If the process dies outright
(SIGKILL, power loss) in between, the next run in that folder finds them and settles it: put back
when no checkpoint of the new run exists, deleted when one does.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from ..errors import LeantuneError
from ..export.full import TOKENIZER_FILES
from ..utils import signals
from .checkpoint import CKPT_DIR, latest_checkpoint, refuse_pickled
from .samples import SAMPLES

FULL_INDEX = "model.safetensors.index.json"
RUN_CONFIG = "run_config.json"  # the run's settings (Trainer.run_settings)
RUN_MARKERS = ("adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", CKPT_DIR,
               FULL_INDEX, RUN_CONFIG)
SET_ASIDE = ".leantune-previous-run"


def run_files(output: Path) -> list[Path]:
    """The files and folders of a run in `output` (what --overwrite replaces): its markers,
    samples.jsonl, the tokenizer files, and a full fine-tune's config and shards. Other files
    are left alone."""
    names = [*RUN_MARKERS, SAMPLES, *TOKENIZER_FILES]
    if (output / FULL_INDEX).exists():
        names.append("config.json")
    found = [output / n for n in names if (output / n).exists()]
    if (output / FULL_INDEX).exists():
        found += sorted(output.glob("model*.safetensors"))
    return found


class RunFolder:
    """The output folder of one run: `check` (reads only), then `begin`, `commit`, `restore`."""

    def __init__(self, output: Path, log=print):
        self.output = Path(output)
        self.aside = self.output / SET_ASIDE
        self.log = log
        self.pending = False  # a previous run is set aside and not yet deleted

    def check(self, resume: bool, overwrite: bool) -> None:
        """Refuse to clobber a previous run unless --overwrite or --resume; --resume needs a
        checkpoint that leantune loads."""
        previous = [m for m in RUN_MARKERS if (self.output / m).exists()]
        if previous and not (resume or overwrite):
            raise LeantuneError(f"{self.output}: output folder holds a previous run "
                                f"({previous[0]}); pass --resume to continue it, --overwrite to "
                                "replace it, or choose another --output")
        if resume:
            ckpt = latest_checkpoint(self.output)
            if ckpt is None:
                raise LeantuneError(f"{self.output}: --resume given but no checkpoint found in "
                                    f"{self.output / CKPT_DIR}; start without --resume")
            refuse_pickled(ckpt)

    def settle_leftover(self) -> None:
        """A previous run left set aside by a process that died: put it back if the run that set
        it aside has no checkpoint, else delete it (that run got going)."""
        if not self.aside.exists():
            return
        if latest_checkpoint(self.output) is not None:
            shutil.rmtree(self.aside)
        else:
            self.pending = True
            self.restore()
            self.log(f"note: put back the previous run that an --overwrite stopped before its "
                     f"first checkpoint had set aside in {self.aside}")

    def begin(self, overwrite: bool) -> None:
        """Create the folder; with `overwrite`, set the previous run's files aside."""
        self.output.mkdir(parents=True, exist_ok=True)
        files = run_files(self.output) if overwrite else []
        if not files:
            return
        with signals.deferred():
            self.aside.mkdir()
            for f in files:
                os.replace(f, self.aside / f.name)
            self.pending = True

    def commit(self) -> None:
        """The new run has a checkpoint: the previous run's files are deleted."""
        if self.pending:
            self.pending = False
            shutil.rmtree(self.aside)

    def restore(self) -> None:
        """The new run stopped before its first checkpoint: its files go, the previous run's come
        back."""
        if not self.pending:
            return
        with signals.deferred():
            for f in run_files(self.output):
                shutil.rmtree(f) if f.is_dir() else f.unlink()
            for f in self.aside.iterdir():
                os.replace(f, self.output / f.name)
            self.aside.rmdir()
            self.pending = False
