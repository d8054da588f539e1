"""GRPO losses: group-normalised advantages and the clipped policy-gradient loss, with the
reductions of GRPO, Dr. GRPO, DAPO, BNPO and GSPO (sequence-level importance ratios).

Shapes: N completions (B prompts x G generations, a prompt's G in a row), C the longest
completion; per-token tensors are [N, C] with `mask` [N, C] (1 on completion tokens that train:
the EOS included, nothing after it; a truncated completion all 0 with mask_truncated).

Advantages (`group_advantages`): A_i = r_i - mean of its group, divided by the group's std
(scale "group"), the std of the whole generation batch ("batch"), or not at all ("none"); the
std has Bessel's correction and 1e-4 is added to it. A NaN reward (no reward function scored
the completion) is left out of the mean and std and gets advantage 0. A group whose rewards are
all equal has advantages exactly 0: its completions contribute no gradient (and no NaN).

Per-token loss (`token_loss`), with r = exp(logp - old_logp) (per token; GSPO: one ratio per
sequence, exp of the masked mean of the log-ratio):
    loss_t = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A)  +  beta * KL_t
    KL_t   = exp(ref - logp) - (ref - logp) - 1              (k3 estimator, beta > 0 only)
Old log-probs are those of the policy that generated (num_iterations > 1); with a single
iteration they are logp detached (r = 1, the gradient is -A d logp).

Reduction over the window (what gradient accumulation divides by; `reduce` gives each
micro-batch's numerator, `normaliser` the window's denominator):
    grpo, gspo  sum over sequences of the sequence's token mean / sequences
    dr_grpo     sum of token losses / (sequences x max_completion_tokens)
    dapo        sum of token losses / the window's trained tokens            (the default)
    bnpo        each micro-batch's token mean, averaged over the micro-batches
These equal TRL's GRPOTrainer losses (importance_sampling_level "sequence" with loss_type grpo
for gspo) on the same tensors, for one micro-batch and for accumulated windows whose
generation batch is the window (tests/train/test_grpo_losses.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import LeantuneError

LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4


def _nanstd(x: torch.Tensor, dim=None, keepdim=False) -> torch.Tensor:
    """Standard deviation with Bessel's correction, NaNs left out (NaN for < 2 values)."""
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    var = torch.where(count > 1, var * count / (count - 1).clamp(min=1), torch.nan)
    std = var.sqrt()
    return std if keepdim else (std.squeeze() if dim is None else std.squeeze(dim))


@dataclass
class Advantages:
    """advantages [N] (0 for NaN rewards); zero_std_groups: how many groups' rewards were all
    equal (so they train nothing); std [N]: the std each reward was divided by (or checked)."""

    advantages: torch.Tensor
    zero_std_groups: int
    std: torch.Tensor


def group_advantages(rewards: torch.Tensor, num_generations: int,
                     scale: str = "group") -> Advantages:
    """rewards [N] (N = groups x G; NaN: unscored) -> Advantages (module docstring)."""
    if scale not in SCALE_REWARDS:
        raise LeantuneError(f"--scale-rewards must be one of {', '.join(SCALE_REWARDS)}, got "
                            f"{scale!r}")
    G = num_generations
    r = rewards.float()
    groups = r.view(-1, G)
    mean = torch.nanmean(groups, dim=1).repeat_interleave(G)
    group_std = _nanstd(groups, dim=1).repeat_interleave(G)
    std = _nanstd(r).expand_as(r) if scale == "batch" else group_std
    adv = r - mean
    if scale != "none":
        adv = adv / (std + STD_EPS)
    adv = torch.nan_to_num(adv, nan=0.0)
    flat = torch.isclose(torch.nan_to_num(group_std.view(-1, G)[:, 0], nan=0.0),
                         torch.zeros(()))
    return Advantages(adv, int(flat.sum()), std)


@dataclass
class TokenLoss:
    """per_token [N, C] loss; ratio: the importance ratio ([N, C], GSPO [N, 1]); kl [N, C] or
    None (beta 0); clipped_low / clipped_high: where the clip took the gradient away (bool,
    the ratio's shape)."""

    per_token: torch.Tensor
    ratio: torch.Tensor
    kl: torch.Tensor | None
    clipped_low: torch.Tensor
    clipped_high: torch.Tensor


def token_loss(logps: torch.Tensor, old_logps: torch.Tensor | None, advantages: torch.Tensor,
               mask: torch.Tensor, *, loss_type: str = "dapo", epsilon_low: float = 0.2,
               epsilon_high: float | None = None, beta: float = 0.0,
               ref_logps: torch.Tensor | None = None) -> TokenLoss:
    """The clipped per-token loss (module docstring). logps [N, C] (with grad), old_logps
    [N, C] or None (= logps detached), advantages [N], mask [N, C] (0/1), ref_logps [N, C]
    when beta > 0."""
    if loss_type not in LOSS_TYPES:
        raise LeantuneError(f"--loss-type {loss_type!r} is not one of {', '.join(LOSS_TYPES)}")
    eps_high = epsilon_low if epsilon_high is None else epsilon_high
    mask = mask.to(logps.dtype)
    old = logps.detach() if old_logps is None else old_logps
    log_ratio = logps - old
    if loss_type == "gspo":
        log_ratio = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    adv = advantages.to(logps.dtype).unsqueeze(-1)  # [N, 1]
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + eps_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference log-probs")
        d = ref_logps - logps
        kl = torch.exp(d) - d - 1
        per_token = per_token + beta * kl
    return TokenLoss(per_token, ratio, kl, (ratio < 1 - epsilon_low) & (adv < 0),
                     (ratio > 1 + eps_high) & (adv > 0))


def reduce(per_token: torch.Tensor, mask: torch.Tensor, loss_type: str,
           max_completion_tokens: int) -> torch.Tensor:
    """A micro-batch's numerator of the window loss (fp32 scalar; module docstring)."""
    mask = mask.to(per_token.dtype)
    masked = per_token * mask
    if loss_type in ("grpo", "gspo"):
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum()
    if loss_type == "dr_grpo":
        return masked.sum() / max_completion_tokens
    if loss_type == "bnpo":
        return masked.sum() / mask.sum().clamp(min=1.0)
    return masked.sum()  # dapo


def normaliser(loss_type: str, sequences: int, tokens: int, micro_batches: int) -> int:
    """The window's denominator (host int) for `reduce`'s numerators: its sequences (grpo,
    gspo, dr_grpo), trained tokens (dapo) or micro-batches (bnpo)."""
    if loss_type == "dapo":
        return tokens
    if loss_type == "bnpo":
        return micro_batches
    return sequences


def masked_sums(loss: TokenLoss, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums over the trained tokens for the metrics (divided by the window's tokens later):
    clip_low, clip_high, clip (either), kl (0 without beta) and tokens. A GSPO ratio counts
    once per token of its sequence."""
    m = mask.to(torch.float32)
    full = lambda t: t.to(torch.float32).expand_as(m)  # noqa: E731 ([N, 1] -> [N, C])
    low, high = full(loss.clipped_low), full(loss.clipped_high)
    out = {"clip_low": (low * m).sum(), "clip_high": (high * m).sum(),
           "clip": (((low + high) > 0).float() * m).sum(), "tokens": m.sum()}
    out["kl"] = (loss.kl.detach().float() * m).sum() if loss.kl is not None else m.sum() * 0
    return {k: v.detach() for k, v in out.items()}
