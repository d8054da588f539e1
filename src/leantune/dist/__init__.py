"""Training on several GPUs with PyTorch's own engines: DDP and FSDP2 under torchrun.

    torchrun --nproc_per_node 8 -m leantune train --model ... --data ...
    accelerate launch --multi_gpu --num_processes 8 -m leantune train --model ... --data ...

setup.py: ranks, device and process group from torchrun's environment; parallel.py: the choice
of DDP or FSDP2 and what each step does under it; ddp.py, fsdp.py: the two engines; data.py:
whole packed rows of each global batch per process; tensors.py: sharded tensors read and written
whole (checkpoints, the final adapter). A process started without torchrun uses none of it.

This module itself imports no torch: the command line asks it which rank prints errors.
"""

from __future__ import annotations

import os


def launched(environ=os.environ) -> bool:
    """Whether this process was started by torchrun (or a launcher that sets its variables)."""
    return "RANK" in environ and "WORLD_SIZE" in environ


def env_rank(environ=os.environ) -> int:
    """This process's rank as the launcher set it (0 without one)."""
    try:
        return int(environ.get("RANK", "0"))
    except ValueError:
        return 0
