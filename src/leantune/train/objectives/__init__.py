"""Training objectives: what a run optimises, as a seam of the trainer.

The trainer (train/trainer.py: set-up; train/runner.py: the step runner) is the same for every
objective. An objective decides which rows it reads and how it batches them, the loss of one
micro-batch as (loss sum, window normaliser, metrics), and what it evaluates and logs:

    sft     next-token cross-entropy over the target tokens (objectives/sft.py)
    dpo, orpo, simpo, kto   preference objectives (objectives/preference.py)
"""

from .base import MicroLoss, Objective
from .sft import SFTObjective

OBJECTIVES = {"sft": SFTObjective}


def objective_for(cfg, log=print) -> Objective:
    """The objective `cfg.objective` names, built for this run."""
    name = getattr(cfg, "objective", "sft") or "sft"
    if name not in OBJECTIVES:
        from ...errors import LeantuneError

        raise LeantuneError(f"--objective {name!r} is not one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[name](cfg, log)


__all__ = ["MicroLoss", "OBJECTIVES", "Objective", "SFTObjective", "objective_for"]
