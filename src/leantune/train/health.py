"""Watching a run for NaN / inf without a host sync per step.

Each step adds "was the loss or the gradient norm non-finite?" to a flag on the device; the flag
is read where the loop syncs anyway (a logged step, a checkpoint), in the same device-to-host
copy as the logged values. With fp16 loss scaling a non-finite gradient is the scaler's overflow
signal: it skips that update and lowers the scale, by design, so such steps are counted, not
fatal (a non-finite loss still is).
"""

from __future__ import annotations

import torch


class NonFiniteWatch:
    def __init__(self, device: torch.device, loss_scaling: bool):
        self.loss_scaling = loss_scaling
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.good_until = 0  # the last step known to be finite

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device ops only (no sync): fold one step's loss and gradient norm into the flag."""
        finite_grad = torch.isfinite(grad_norm)
        if self.loss_scaling:
            self.skipped += ~finite_grad
            self.bad |= ~torch.isfinite(loss)
        else:
            self.bad |= ~(torch.isfinite(loss) & finite_grad)

    def read(self, step: int, *values: torch.Tensor) -> tuple[list[float], bool, int]:
        """(`values` as floats, whether anything was non-finite up to `step`, steps the loss
        scaler skipped so far), in one device-to-host copy."""
        parts = [v.detach().float().reshape(()) for v in values]
        out = torch.stack([*parts, self.bad.float(), self.skipped.float()]).tolist()
        bad = bool(out[-2])
        if not bad:
            self.good_until = step
        return out[:-2], bad, int(out[-1])
