"""Parameter counts as a user reads them ("trainable parameters: N of M").

A QLoRA base holds its decoder projections as 4-bit NF4 weights (kernels/nf4.py NF4Weight):
packed codes and scales registered as *buffers*, not parameters, so `model.parameters()` misses
them (and their packed bytes hold two weights each). Each such weight counts as the out x in
parameters it stands for, so a 4-bit model reports the same total as its 16-bit original.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


def count_parameters(model: torch.nn.Module,
                     trainable: Iterable[torch.Tensor] | None = None) -> tuple[int, int]:
    """(trainable, total) parameter counts of `model`. `trainable`: the tensors trained (default
    those with requires_grad); total: every parameter, each shared tensor once (tied
    embeddings), plus the real size of each NF4 (or FP8) weight."""
    from ..kernels.fp8 import FP8Weight
    from ..kernels.nf4 import NF4Weight

    params = list(model.parameters())  # (deduplicated by the module tree)
    chosen = [p for p in params if p.requires_grad] if trainable is None else list(trainable)
    n_train = sum(p.numel() for p in {id(p): p for p in chosen}.values())
    n_all = sum(p.numel() for p in params)
    n_all += sum(m.numel for m in model.modules() if isinstance(m, (NF4Weight, FP8Weight)))
    return n_train, n_all
