"""Training objectives: what a run optimises, as a seam of the trainer.

The trainer (train/trainer.py: set-up; train/runner.py: the step runner) is the same for every
objective. An objective decides which rows it reads and how it batches them, the loss of one
micro-batch as (loss sum, window normaliser, metrics), and what it evaluates and logs:

    sft     next-token cross-entropy over the target tokens (objectives/sft.py)
    dpo, orpo, simpo, kto   preference objectives (objectives/preference.py)
    grpo    online RL: rollouts by leantune's generation, rewards, clipped policy gradient
            (objectives/grpo.py)

An objective may also define (the runner uses them when present): next_window(runner,
batches) -> the step's micro-batches (GRPO: its rollouts); finish_metrics(sums, n) -> the
logged device metrics of the window's sums; host_metrics() -> host floats for the step's
record; progress_metrics(record) -> what the progress line shows; checks_stall = False.
"""

from .base import MicroLoss, Objective
from .grpo import GRPOObjective
from .preference import PREFERENCE_OBJECTIVES
from .sft import SFTObjective

OBJECTIVES = {"sft": SFTObjective, **PREFERENCE_OBJECTIVES, "grpo": GRPOObjective}


def objective_class(name: str) -> type[Objective]:
    """The Objective class `--objective name` picks; one line naming those there are if none."""
    if name not in OBJECTIVES:
        from ...errors import LeantuneError
        from ...utils.suggest import did_you_mean

        raise LeantuneError(f"--objective {name}: no such objective"
                            f"{did_you_mean(name.lower(), OBJECTIVES, cutoff=0.6)}; the objectives are "
                            f"{', '.join(OBJECTIVES)}")
    return OBJECTIVES[name]


def objective_for(cfg, log=print) -> Objective:
    """The objective `cfg.objective.name` (a TrainConfig's ObjectiveSettings) names, built for
    this run (it reads the whole `cfg`: the data flags, and its section's settings)."""
    return objective_class(cfg.objective.name)(cfg, log)


__all__ = ["GRPOObjective", "MicroLoss", "OBJECTIVES", "Objective", "SFTObjective", "objective_class",
           "objective_for"]
