"""Watching a run for NaN / inf, and for a run that stopped learning, without a host sync per
step.

Each step adds "was the loss or the gradient norm non-finite?" to a flag on the device; the flag
is read where the loop syncs anyway (a logged step, a checkpoint), in the same device-to-host
copy as the logged values. With fp16 loss scaling a non-finite gradient is the scaler's overflow
signal: it skips that update and lowers the scale, by design, so such steps are counted, not
fatal (a non-finite loss still is).

The same copy carries StallWatch's counters: consecutive steps whose gradient norm was exactly
0 (nothing reaches the trainable weights: the run is stopped, with what to try) and whose loss
equalled the previous step's to the last bit (the weights do not move: a warning).
"""

from __future__ import annotations

import math

import torch

from ..errors import LeantuneError

# consecutive steps of an exactly-zero gradient norm (or a bit-identical loss) that count as a
# stall: training never does this by chance (the loss of a real update moves in float32)
STALL_STEPS = 5


class NonFiniteWatch:
    def __init__(self, device: torch.device, loss_scaling: bool):
        self.loss_scaling = loss_scaling
        self.bad = torch.zeros((), dtype=torch.bool, device=device)
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)
        self.good_until = 0  # the last step known to be finite
        self.stall = StallWatch(device)

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device ops only (no sync): fold one step's loss and gradient norm into the flag (and
        the stall counters)."""
        self.stall.observe(loss, grad_norm)
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
        stall = self.stall.tensors()
        out = torch.stack([*parts, *stall, self.bad.float(), self.skipped.float()]).tolist()
        bad = bool(out[-2])
        if not bad:
            self.good_until = step
        self.stall.seen(*out[len(parts):len(parts) + len(stall)])
        return out[:len(parts)], bad, int(out[-1])


class StallWatch:
    """Counts, on the device, the consecutive steps up to now whose gradient norm was exactly 0
    and whose loss was bit for bit the previous step's; `check` reads the counts (after
    NonFiniteWatch.read has copied them in its one sync) and says what they mean."""

    def __init__(self, device: torch.device, steps: int = STALL_STEPS):
        self.steps = steps
        self.zero = torch.zeros((), dtype=torch.float32, device=device)  # (float: one copy)
        self.same = torch.zeros((), dtype=torch.float32, device=device)
        self.prev = torch.full((), math.nan, dtype=torch.float32, device=device)
        self.zero_steps, self.flat_steps, self.loss = 0, 0, math.nan  # as last read
        self.warned = False

    def observe(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        """Device ops only: one step's loss and gradient norm (NaN never equals anything)."""
        loss = loss.detach().float().reshape(())
        self.zero = torch.where(grad_norm.detach().reshape(()) == 0, self.zero + 1, 0.0)
        self.same = torch.where(loss == self.prev, self.same + 1, 0.0)
        self.prev = loss.clone()

    def tensors(self) -> list[torch.Tensor]:
        return [self.zero, self.same, self.prev]

    def seen(self, zero: float, same: float, loss: float) -> None:
        """The counters as copied to the host: the loss was flat for `same` + 1 steps."""
        self.zero_steps, self.flat_steps, self.loss = int(zero), int(same) + 1, loss

    def check(self, step: int, cfg, warn) -> LeantuneError | None:
        """After a read at `step`: the error that stops a run whose gradient norm has been
        exactly 0 for `steps` steps while the loss is not 0 (nothing it trains can change the
        loss); `warn(line)`, once a run, for a loss flat to the last digit (the weights do not
        move), or a loss of exactly 0 (the model reproduces its training data exactly: nothing
        left to learn, though its adapter is worth keeping). None: the run goes on."""
        n = self.zero_steps
        if n >= self.steps and self.loss != 0:
            return LeantuneError(
                f"steps {step - n + 1}-{step}: the gradient norm was exactly 0 while the loss "
                f"stayed at {self.loss:.4f}: nothing reaches the trainable weights, so training "
                f"stopped learning and was stopped (no final "
                f"{'model' if cfg.full else 'adapter'} was written; earlier checkpoints are "
                f"kept); {stall_advice(cfg)}, in a new run (--overwrite)")
        if self.warned:
            return None
        if n >= self.steps or (self.flat_steps >= self.steps and self.loss == 0):
            self.warned = True
            warn(f"note: step {step}: the loss is 0 and the gradient norm 0: the model "
                 "reproduces every trained token of its data exactly, so further steps teach "
                 "it nothing (add data, or fewer --max-steps / --epochs)")
        elif self.flat_steps >= self.steps:
            self.warned = True
            warn(f"warning: steps {step - self.flat_steps + 1}-{step}: the loss was "
                 f"{self.loss!r} to the last digit each step: the weights are not changing; "
                 f"{flat_advice(cfg)}")
        return None


def stall_advice(cfg) -> str:
    """What to try when the gradient norm is exactly 0: too high an --lr saturates the model
    (its softmax or activations stop passing gradients); a LoRA scale of ~0 passes none."""
    tips = []
    if not cfg.full and cfg.lora.alpha / cfg.lora.r < 1e-6:
        tips.append(f"--lora-alpha {cfg.lora.alpha:g} scales the adapter by "
                    f"{cfg.lora.alpha / cfg.lora.r:.3g}, which passes no gradient: use an alpha "
                    "near --lora-r")
    if cfg.lr > 1e-2 or not tips:
        clip = ("" if cfg.max_grad_norm > 0
                else " with gradient clipping (--max-grad-norm 1.0)")
        tips.append(f"try a lower --lr (now {cfg.lr:g}; 1e-4 to 2e-4 are usual for LoRA, 1e-5 "
                    f"for --full){clip}")
    return "; ".join(tips)


def flat_advice(cfg) -> str:
    if cfg.lr < 1e-7:
        return (f"--lr {cfg.lr:g} is too small to move them (1e-4 to 2e-4 are usual for LoRA, "
                "1e-5 for --full)")
    return ("the updates are below the weights' precision: raise --lr (now "
            f"{cfg.lr:g}), or train in float32 (--dtype float32)")


def diverged_advice(cfg) -> str:
    """What to try after a NaN / inf. AdamW's decoupled weight decay scales every trained
    weight by (1 - lr x weight_decay) each step: from lr x weight_decay >= 1 on, the decay alone
    flips and grows the weights until they overflow, whatever the learning rate's own size, so
    the advice is then about --weight-decay, not --lr."""
    wd, lr = cfg.weight_decay, cfg.lr
    if wd * lr >= 1:
        return (f"--weight-decay {wd:g} is far too high: each step scales the weights by "
                f"1 - lr x weight decay = {1 - lr * wd:.3g}, which makes them overflow; use "
                "0.01 to 0.1 (or 0)")
    clip = (f"a lower --max-grad-norm (now {cfg.max_grad_norm})" if cfg.max_grad_norm > 0
            else "gradient clipping, --max-grad-norm 1.0")
    high = (f"; --weight-decay {wd:g} is also unusually high (0.01 to 0.1 are usual)"
            if wd > 1 else "")
    return f"try a lower --lr (now {lr:g}) or {clip}{high}"
