"""A run's output folder: one run at a time, what marks a previous run, replacing one
(--overwrite) without losing it before the new run is worth more, and a final save that a kill
cannot leave half done.

Every sequence of writes here is a short journal whose every prefix is recoverable: a kill at
any rename or delete (tests kill at each one: utils/faults.py) leaves files that the next run in
the folder puts right before it does anything else (`RunFolder.settle_leftover`).

--overwrite. The previous run's files (`run_files`: its adapter, checkpoints, metrics, samples,
plot, tensorboard logs, merged/ model, tokenizer files, an objective's tables: a preference
run's precomputed reference log-probs, GRPO's rollouts in progress...) are renamed into
OUTPUT/.leantune-previous-run, no copy and nothing deleted, under the journal
OUTPUT/.leantune-overwrite.json, whose phase says what a kill interrupted:
    moving     setting the files aside       -> put back what was moved
    aside      the new run is going          -> new run has a checkpoint? delete : put back
    deleting   the new run has a checkpoint  -> finish deleting the previous run
    clearing   the new run stopped early     -> finish deleting the new run's files, put back
    returning  putting the previous run back -> finish putting it back
The previous run goes only once the new run is worth more: its first scheduled checkpoint
(--save-every, or its last step). A stop before that (Ctrl-C, an error, a NaN) puts it back.

The final save (adapter or model files, tokenizer) runs under OUTPUT/.leantune-final-save.json:
while that file is there the final files are incomplete, and `--resume` writes them again from
the last checkpoint instead of calling the run finished.

A run stopped before its first checkpoint (Ctrl-C before the first step, a closed stdout pipe,
a kill) leaves run_config.json and metrics.jsonl but nothing to resume: a new run in that folder
replaces them (as --overwrite would, set aside until it has a checkpoint) instead of refusing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

from ..errors import LeantuneError
from ..export.full import TOKENIZER_FILES
from ..export.shards import INDEX as FULL_INDEX
from ..utils import signals
from ..utils.io import atomic_write_json, fsync_dir, remove, replace
from ..utils.lock import lock_run
from .checkpoint import CKPT_DIR, check_resume_settings, latest_checkpoint, refuse_pickled
from .merge_at_end import MERGED_DIR, remove_stale_merge_lock
from .objectives.grpo import ROLLOUTS_FILE
from .objectives.preference import REFERENCE_FILE
from .plot import PLOT_NAME
from .reporting import TENSORBOARD_DIR
from .samples import SAMPLES

RUN_CONFIG = "run_config.json"  # the run's settings (Trainer.run_settings)
FINAL_JOURNAL = ".leantune-final-save.json"  # there while the final save is incomplete
RUN_MARKERS = ("adapter_config.json", "adapter_model.safetensors", "metrics.jsonl", CKPT_DIR,
               FULL_INDEX, RUN_CONFIG, FINAL_JOURNAL)
# what an objective keeps in the run folder: a new run must compute its own (a preference
# run's reference log-probs are refused when they are another data's, not recomputed)
OBJECTIVE_FILES = (REFERENCE_FILE, ROLLOUTS_FILE)
# markers of a run that has something to keep (a checkpoint, or a final result)
RESULT_MARKERS = ("adapter_config.json", "adapter_model.safetensors", FULL_INDEX, FINAL_JOURNAL)
SET_ASIDE = ".leantune-previous-run"
JOURNAL = ".leantune-overwrite.json"
_STALE = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}|\.save-\d+-[0-9a-f]{8}")


def run_files(output: Path) -> list[Path]:
    """The files and folders of a run in `output` (what --overwrite replaces): its markers,
    samples, plot, tensorboard logs, merged model, the objectives' files, the tokenizer files,
    and a full fine-tune's config and shards. Other files are left alone."""
    names = [*RUN_MARKERS, SAMPLES, PLOT_NAME, TENSORBOARD_DIR, MERGED_DIR, *OBJECTIVE_FILES,
             *TOKENIZER_FILES]
    if (output / FULL_INDEX).exists():
        names.append("config.json")
    found = [output / n for n in names if (output / n).exists() or (output / n).is_symlink()]
    if (output / FULL_INDEX).exists():
        found += sorted(output.glob("model*.safetensors"))
    return found


class RunFolder:
    """The output folder of one run: `settle_leftover` (locks it, mends what a kill left),
    `check` (reads only), then `begin`, `commit` or `restore`."""

    def __init__(self, output: Path, log=print):
        self.output = Path(output)
        self.aside = self.output / SET_ASIDE
        self.journal = self.output / JOURNAL
        self.log = log
        self.pending = False  # a previous run is set aside and not yet deleted
        self.replace_unstarted = False  # the folder holds a run stopped before its checkpoint

    # --- the journal ---------------------------------------------------------------------------
    def _phase(self) -> str | None:
        try:
            return json.loads(self.journal.read_text())["phase"]
        except FileNotFoundError:
            return "aside" if self.aside.is_dir() else None  # (set aside by leantune <= 0.3)
        except (ValueError, KeyError, TypeError):
            # cut short by a crash: atomic writes make this unlikely; treat as still moving
            return "moving"

    def _set_phase(self, phase: str) -> None:
        atomic_write_json(self.journal, {"phase": phase})

    def _finish(self) -> None:
        remove(self.journal)
        fsync_dir(self.output)
        self.pending = False

    def _put_back(self) -> None:
        """Move what is in the set-aside folder back (files of that name in OUTPUT are the
        new run's, or were never moved: the moved one wins only where none is there)."""
        for f in sorted(self.aside.iterdir()) if self.aside.is_dir() else []:
            dst = self.output / f.name
            if dst.exists() or dst.is_symlink():
                remove(dst)
            replace(f, dst)
        if self.aside.is_dir():
            self.aside.rmdir()

    def _roll_back(self, phase: str) -> None:
        """Put the previous run back from `phase` on (a stop before the new run's first
        checkpoint, or a kill in the middle of any step)."""
        with signals.deferred():
            if phase == "moving":  # the new run wrote nothing yet: only moves to undo
                for f in sorted(self.aside.iterdir()) if self.aside.is_dir() else []:
                    if not (self.output / f.name).exists():
                        replace(f, self.output / f.name)
                    else:
                        remove(f)  # (cannot happen: a name is in one place or the other)
                if self.aside.is_dir():
                    self.aside.rmdir()
                self._finish()
                return
            if phase in ("aside", "clearing"):
                self._set_phase("clearing")
                aside = {f.name for f in self.aside.iterdir()} if self.aside.is_dir() else set()
                for f in run_files(self.output):
                    remove(f)
                for name in aside:  # (a full run's shards run_files no longer sees)
                    if (self.output / name).exists():
                        remove(self.output / name)
            self._set_phase("returning")
            self._put_back()
            self._finish()

    def _delete_aside(self) -> None:
        with signals.deferred():
            self._set_phase("deleting")
            if self.aside.exists():
                remove(self.aside)
            self._finish()

    # --- the steps of a run ----------------------------------------------------------------------
    def settle_leftover(self) -> None:
        """Lock the folder (one run at a time: a second is refused naming the first's PID),
        then finish what a killed process left: an --overwrite's set-aside (put back, or
        deleted if the run that set it aside has a checkpoint)."""
        lock_run(self.output)
        self._remove_stale_temporaries()
        phase = self._phase()
        if phase is None:
            return
        if phase == "deleting" or (phase == "aside"
                                   and latest_checkpoint(self.output) is not None):
            self._delete_aside()
            return
        self._roll_back(phase)
        self.log(f"note: put back the previous run that an --overwrite stopped before its "
                 f"first checkpoint had set aside in {self.aside}")

    def _remove_stale_temporaries(self) -> None:
        """The temporary files and folders of writes a killed run left (utils/io's
        `.NAME.tmp-PID-XXXXXXXX`, `.save-PID-XXXXXXXX`, a checkpoint's `.tmp-step-N`): this
        process holds the folder's lock, so none is another run's."""
        if not self.output.is_dir() or self.output.is_symlink():
            return
        ckpts = self.output / CKPT_DIR
        found = [*(p for p in self.output.iterdir() if _STALE.fullmatch(p.name)),
                 *(ckpts.glob(".tmp-step-*") if ckpts.is_dir() and not ckpts.is_symlink()
                   else [])]
        for p in found:
            remove(p)
        remove_stale_merge_lock(self.output)

    def check(self, resume: bool, overwrite: bool, cfg=None) -> None:
        """Refuse to clobber a previous run unless --overwrite or --resume; --resume needs a
        checkpoint that leantune loads, whose state.json is sound and whose settings are
        `cfg`'s (checked here, before the weights load). A run stopped before its first
        checkpoint is no previous run: it is replaced (its files set aside until this run has a
        checkpoint)."""
        if not overwrite:  # (--overwrite sets a previous run's entries aside, links as links)
            self.refuse_linked_entries()
        previous = [m for m in RUN_MARKERS if (self.output / m).exists()]
        if previous and not (resume or overwrite):
            if self.unstarted():
                self.replace_unstarted = True
                self.log(f"note: {self.output} holds a run stopped before its first checkpoint "
                         f"({', '.join(previous)}); this run replaces it")
            else:
                raise LeantuneError(f"{self.output}: output folder holds a previous run "
                                    f"({previous[0]}); pass --resume to continue it, --overwrite "
                                    "to replace it, or choose another --output")
        if resume:
            ckpt = latest_checkpoint(self.output)
            if ckpt is None:
                raise LeantuneError(f"{self.output}: --resume given but no checkpoint found in "
                                    f"{self.output / CKPT_DIR}; start without --resume")
            refuse_pickled(ckpt)
            if cfg is not None:
                check_resume_settings(ckpt, cfg)

    def refuse_linked_entries(self) -> None:
        """One line, before the weights load, for a link at a name the run writes into in place
        (the metrics and samples logs, the checkpoint and TensorBoard folders, a checkpoint's
        step folder): the writers refuse it anyway, but only after the model has loaded."""
        from ..utils.io import refuse_link_at

        ckpts = self.output / CKPT_DIR
        names = [self.output / n for n in ("metrics.jsonl", SAMPLES, CKPT_DIR, TENSORBOARD_DIR)]
        if ckpts.is_dir() and not ckpts.is_symlink():
            names += sorted(ckpts.iterdir())
        for path in names:
            refuse_link_at(path, "run folder's " + path.name)

    def unstarted(self) -> bool:
        """A run that left files but nothing to resume or use: no checkpoint, no final result."""
        return (latest_checkpoint(self.output) is None
                and not any((self.output / m).exists() for m in RESULT_MARKERS))

    def begin(self, overwrite: bool) -> None:
        """Create the folder; with `overwrite` (or over a run stopped before its first
        checkpoint), set the previous run's files aside."""
        self.output.mkdir(parents=True, exist_ok=True)
        files = run_files(self.output) if overwrite or self.replace_unstarted else []
        if not files:
            return
        with signals.deferred():
            self._set_phase("moving")
            self.pending = True
            self.aside.mkdir(exist_ok=True)
            for f in files:
                replace(f, self.aside / f.name)
            fsync_dir(self.output)
            self._set_phase("aside")

    def commit(self) -> None:
        """The new run has a checkpoint: the previous run's files are deleted."""
        if self.pending:
            self._delete_aside()

    def restore(self) -> None:
        """The new run stopped before its first checkpoint: its files go, the previous run's come
        back."""
        if self.pending:
            self._roll_back(self._phase() or "aside")


def overwrite_stopped_note(output: Path, steps: int) -> str:
    """What a stop of an --overwrite run before its first checkpoint did (the trainer's line)."""
    dropped = f"; this run's {steps} steps are dropped" if steps else ""
    return (f"the previous run in {output} is put back as it was{dropped} (--overwrite replaces "
            "it only from this run's first checkpoint, --save-every); run the same command to "
            "start again")


def resume_hint(cfg) -> str:
    """How to continue a stopped run: its own command plus --resume (in place of --overwrite,
    which --resume refuses)."""
    return ("the same command with --resume in place of --overwrite" if cfg.overwrite
            else "the same command plus --resume")


# --- the final save ------------------------------------------------------------------------------

@contextlib.contextmanager
def final_save(output: Path, step: int, write: bool = True):
    """Run the final save of step `step` inside this: its journal marks the final files
    incomplete until every one is written."""
    if write:
        atomic_write_json(Path(output) / FINAL_JOURNAL, {"step": step})
    yield
    if write:
        remove(Path(output) / FINAL_JOURNAL)
        fsync_dir(output)


def final_incomplete(output: Path, full: bool, ckpt: Path | None) -> str | None:
    """Why the final files of a finished run need writing again (from its last checkpoint
    `ckpt`), or None: a final save cut short, a file missing, or older than the checkpoint."""
    output = Path(output)
    if (output / FINAL_JOURNAL).exists():
        return "its final save was cut short"
    need = ([FULL_INDEX, "config.json"] if full and (output / FULL_INDEX).exists() else
            ["model.safetensors", "config.json"] if full else
            ["adapter_model.safetensors", "adapter_config.json"])
    for name in need:
        if not (output / name).exists():
            return f"{name} is missing"
        if ckpt is not None and (output / name).stat().st_mtime < ckpt.stat().st_mtime:
            return f"{name} is older than {ckpt.name}"
    return None
