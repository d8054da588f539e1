"""The Objective interface: the part of a training run that differs between SFT, DPO, GRPO...

The step runner (train/runner.py) calls `objective.prepare(model, train_loader, parallel)` once
before the first step of each run (a fresh one, and each resume), then per optimizer step over a
window of micro-batches:

    n = objective.normaliser(window)                 # host int (the global window's)
    for b in window:
        out = objective.loss(model, b.to(device))    # MicroLoss, tensors on the device
        ((out.loss_sum / n) + aux...).backward()
    logged loss   = sum(out.loss_sum) / n
    logged metric = sum(out.metrics[k]) / n          # each metric is a sum over the micro-batch

so gradient accumulation is exact for any objective whose loss is a sum over units (target
tokens for SFT, pairs for DPO) divided by the units of the whole window. No host sync happens
inside `loss`: metrics stay on the device and are read once per logged step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MicroLoss:
    """The loss of one micro-batch.

    loss_sum: fp32 scalar, the sum over the micro-batch's units (divided by the window's
        normaliser before backward).
    aux_loss: the MoE router's load-balancing loss of this micro-batch (a mean), or None.
    metrics: name -> fp32 scalar sum over the micro-batch's units (detached)."""

    loss_sum: torch.Tensor
    aux_loss: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)


class Objective:
    """Base class. Subclasses set `name` and `metric_names` and implement the methods below."""

    name = "?"
    metric_names: tuple[str, ...] = ()  # keys of MicroLoss.metrics, logged beside the loss
    unit = "tokens"  # what the normaliser counts (shown in the data line)

    def __init__(self, cfg, log=print):
        self.cfg, self.log = cfg, log

    # --- data ------------------------------------------------------------------------------
    def build_data(self, tokenizer, train_data, eval_data):
        """(train, eval or None) datasets for this objective; given ones pass through."""
        raise NotImplementedError

    def make_loader(self, data, loader_cls, shuffle: bool):
        """A resumable loader over `data` (state_dict / load_state_dict / iter_batches / len)."""
        raise NotImplementedError

    def check_token_ids(self, data, vocab: int, what: str) -> None:
        """Every token id must index the embedding: one line naming the row otherwise."""

    # --- before training ---------------------------------------------------------------------
    def prepare(self, model, train_loader, parallel) -> None:
        """Called by the runner once before the first step, and again when a run resumes (a new
        process): work over the data that precedes training, e.g. a preference objective's
        reference log-probs. `model` is the unwrapped model in train mode; `train_loader` is
        at the run's position (resumed: the checkpoint's). Default: nothing."""

    # --- the loss --------------------------------------------------------------------------
    def normaliser(self, micro_batches) -> int:
        """Units of the whole (global) window: the loss sums are divided by it."""
        raise NotImplementedError

    def loss(self, model, batch) -> MicroLoss:
        """The loss of one micro-batch (on the device) through `model` (maybe DDP-wrapped:
        called as model(batch=..., ...), so the wrappers see the whole forward)."""
        raise NotImplementedError

    def tokens(self, micro_batches) -> int:
        """Real (non-padding) tokens of the window, for tokens/s."""
        from ...dist.data import window_tokens

        return window_tokens(micro_batches)[1]

    # --- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, model, loader, parallel) -> dict[str, float]:
        """Metrics over the eval loader: {"eval_loss": ..., "eval_<metric>": ...}; one host
        read at the end."""
        total = None
        n = 0
        for batch in loader:
            out = self.loss(model, batch.to(parallel.device))
            vals = torch.stack([out.loss_sum.float()] + [out.metrics[k].float()
                                                         for k in self.metric_names])
            total = vals if total is None else total + vals
            n += self.normaliser([batch])
        if total is None:  # no batches (every process has as many: the sum below still meets)
            total = torch.zeros(1 + len(self.metric_names), device=parallel.device)
        vals = (parallel.sum_(total) / max(n, 1)).tolist()
        return {"eval_loss": vals[0], **{f"eval_{k}": v
                                         for k, v in zip(self.metric_names, vals[1:])}}
