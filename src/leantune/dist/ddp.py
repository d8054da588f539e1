"""DDP (DistributedDataParallel) over the trainable parameters only: LoRA adapters, or every
weight with --full.

The frozen base is loaded by every process from the same checkpoint and never changes, so DDP
ignores it (and any buffers): no broadcast at the start or per step, no gradient buckets (and a
frozen input embedding may live in pinned host memory). The trainables' gradients are
all-reduced in buckets while backward runs: the fused layers' hand-written backward returns the
LoRA gradients from their autograd Function, so DDP's hooks fire as for any layer. Gradient
accumulation runs all micro-batches but the last of a window under `no_sync`. DDP's
static_graph is left off: with it the first backward's gradients came out unreduced (the ranks'
differed; torch 2.13, gloo), and with every trainable used in every step
(find_unused_parameters off) it has little to add. Inputs are not moved by DDP (no device_ids):
the trainer moves each batch itself.
"""

from __future__ import annotations

import torch


def wrap(model: torch.nn.Module) -> torch.nn.Module:
    """`model` under DDP; call the returned module for the training forward."""
    from torch.nn.parallel import DistributedDataParallel

    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    frozen += [n for n, _ in model.named_buffers()]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, frozen)
    return DistributedDataParallel(model, gradient_as_bucket_view=True)
