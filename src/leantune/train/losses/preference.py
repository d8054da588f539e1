"""Preference losses on per-sequence log-probabilities: DPO (sigmoid, IPO, hinge), ORPO, SimPO, KTO.

Every function here is pure torch on small per-sequence tensors; the model forward that produces
them is elsewhere. The inputs are, for each completion,

    logps   [P] fp32  the sum over the completion's tokens of log p(token | prefix)
    tokens  [P]       the number of those tokens (for the length-normalised losses)

where P is the number of pairs in the micro-batch (chosen and rejected completions of pair i at
index i of their tensors) or, for KTO, the number of unpaired rows. `sum_by_document` turns the
per-token log-probs of packed rows into these sums.

Each function returns a `PreferenceLoss`: ``losses`` [P] (one value per pair or row, to be
averaged over the pairs or rows), an optional token-level NLL term (ORPO, SimPO with an NLL
weight) kept as a sum and a token count so that gradient accumulation over micro-batches can
divide each by the window's own total, and detached per-unit metrics. ``mean()`` is the loss of
the micro-batch on its own, as TRL computes it.

The semantics follow TRL 1.16 (DPOTrainer, experimental CPOTrainer / ORPOTrainer, KTOTrainer);
tests/train/test_preference_losses.py checks values and gradients against TRL's own code:

* DPO rewards are ``beta * (policy - reference)`` summed log-probs, detached. IPO divides each
  log-ratio by its completion's token count before the squared loss (TRL does; the authors
  confirmed it). Label smoothing (conservative DPO) mixes in the flipped-label loss; TRL 1.16's
  DPO sigmoid no longer takes it (TRL's CPO sigmoid loss keeps this form).
* ORPO and SimPO are reference-free and use length-averaged log-probs; their rewards are
  ``beta * average log-prob``.
* KTO compares each row's log-ratio with a batch estimate of KL(policy || reference) built from
  mismatched (prompt, completion) pairs, clamped at 0 and detached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from leantune.errors import LeantuneError

DPO_LOSS_TYPES = ("sigmoid", "ipo", "hinge")

# Defaults, as in TRL 1.16's configs (the one place they live: the objectives and
# TrainConfig.validate read them).
DPO_BETA = 0.1
ORPO_BETA = 0.1
SIMPO_BETA = 0.1
SIMPO_GAMMA = 0.5
KTO_BETA = 0.1
DEFAULT_BETAS = {"dpo": DPO_BETA, "orpo": ORPO_BETA, "simpo": SIMPO_BETA, "kto": KTO_BETA}

_LOG_HALF = -math.log(2.0)


@dataclass
class PreferenceLoss:
    """The loss of one micro-batch of pairs (or KTO rows), split into its reducible parts.

    Attributes:
        losses: [P] per-pair (or per-row) losses; averaged over pairs.
        nll_sum: scalar, the (weighted) summed NLL of the tokens the NLL term covers, or None.
        nll_tokens: scalar, the number of those tokens, or None.
        metrics: name -> detached tensor, [P] per pair/row or a scalar (KTO's "kl").
    """

    losses: torch.Tensor
    nll_sum: torch.Tensor | None = None
    nll_tokens: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)

    def mean(self) -> torch.Tensor:
        """The micro-batch loss on its own: mean over pairs, plus the token-mean NLL."""
        loss = self.losses.mean()
        if self.nll_sum is not None:
            loss = loss + self.nll_sum / self.nll_tokens.clamp(min=1)
        return loss


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------

def sum_by_document(token_logps: torch.Tensor, doc_index: torch.Tensor, num_docs: int,
                    mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-document sums of per-token log-probs.

    Args:
        token_logps: [N] fp32 log p of each token's target (any layout, e.g. flattened B*T).
        doc_index: [N] int64, which document (0..num_docs-1) each token belongs to; tokens with
            a negative index (padding) are ignored.
        num_docs: number of documents D.
        mask: [N] bool, the tokens that count (the completion's targets); None: all.

    Returns:
        (sums [D] fp32, counts [D] int64): summed log-probs and counted tokens per document.
    """
    keep = doc_index >= 0
    if mask is not None:
        keep = keep & mask
    idx = torch.where(keep, doc_index, torch.zeros_like(doc_index))
    vals = torch.where(keep, token_logps.float(), torch.zeros_like(token_logps, dtype=torch.float32))
    sums = torch.zeros(num_docs, dtype=torch.float32, device=token_logps.device).index_add(0, idx, vals)
    counts = torch.zeros(num_docs, dtype=torch.long, device=token_logps.device).index_add(
        0, idx, keep.long())
    return sums, counts


def log1m_exp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x <= 0, accurate at both ends (Maechler 2012): log1p(-exp(x)) where
    exp(x) is small, log(-expm1(x)) where x is near 0."""
    return torch.where(x < _LOG_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _check_beta(beta: float, flag: str = "--beta") -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not beta > 0:
        raise LeantuneError(f"{flag} must be a positive number, got {beta!r}")
    return float(beta)


def _check_smoothing(label_smoothing: float) -> float:
    if not 0.0 <= float(label_smoothing) < 0.5:
        raise LeantuneError(f"--label-smoothing must be in [0, 0.5), got {label_smoothing!r}")
    return float(label_smoothing)


def _smoothed_sigmoid_loss(logits: torch.Tensor, beta: float, label_smoothing: float
                           ) -> torch.Tensor:
    """-log sigmoid(beta * logits), mixed with the flipped label by `label_smoothing`. [P]"""
    loss = -F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
    if label_smoothing:
        loss = loss - F.logsigmoid(-beta * logits) * label_smoothing
    return loss


def _pair_metrics(chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
                  chosen_logps: torch.Tensor, rejected_logps: torch.Tensor) -> dict:
    """Per-pair detached metrics shared by the pairwise losses (each [P])."""
    c, r = chosen_rewards.detach(), rejected_rewards.detach()
    return {"rewards_chosen": c, "rewards_rejected": r, "reward_margin": c - r,
            "reward_accuracy": (c > r).float(),
            "logps_chosen": chosen_logps.detach(), "logps_rejected": rejected_logps.detach()}


def _average(logps: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Length-averaged log-probs [P]: summed log-probs over the token counts (at least 1)."""
    return logps / tokens.to(logps.dtype).clamp(min=1)


# --------------------------------------------------------------------------------------------
# DPO
# --------------------------------------------------------------------------------------------

def dpo_loss(policy_chosen_logps: torch.Tensor, policy_rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor, ref_rejected_logps: torch.Tensor, *,
             beta: float = DPO_BETA, loss_type: str = "sigmoid", label_smoothing: float = 0.0,
             chosen_tokens: torch.Tensor | None = None,
             rejected_tokens: torch.Tensor | None = None) -> PreferenceLoss:
    """Direct preference optimisation against a frozen reference.

    All log-prob inputs are [P] summed completion log-probs; the reference ones carry no grad.
    With h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected):

        sigmoid  -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)   (eps: label smoothing)
        hinge    relu(1 - beta h)
        ipo      (h_avg - 1 / (2 beta))^2, h_avg with each log-ratio divided by its token count
                 (needs `chosen_tokens` and `rejected_tokens`, [P])

    Returns:
        PreferenceLoss with losses [P] and metrics rewards_chosen / rewards_rejected (beta times
        the summed log-ratios), reward_margin, reward_accuracy, logps_chosen / logps_rejected.
    """
    beta = _check_beta(beta)
    if loss_type not in DPO_LOSS_TYPES:
        raise LeantuneError(f"--loss-type {loss_type!r} is not one of {', '.join(DPO_LOSS_TYPES)}")
    chosen_ratio = policy_chosen_logps - ref_chosen_logps
    rejected_ratio = policy_rejected_logps - ref_rejected_logps
    if loss_type == "sigmoid":
        losses = _smoothed_sigmoid_loss(chosen_ratio - rejected_ratio, beta,
                                        _check_smoothing(label_smoothing))
    elif loss_type == "hinge":
        losses = torch.relu(1.0 - beta * (chosen_ratio - rejected_ratio))
    else:
        if chosen_tokens is None or rejected_tokens is None:
            raise ValueError("the ipo loss needs chosen_tokens and rejected_tokens")
        h_avg = _average(chosen_ratio, chosen_tokens) - _average(rejected_ratio, rejected_tokens)
        losses = (h_avg - 1.0 / (2.0 * beta)) ** 2
    metrics = _pair_metrics(beta * chosen_ratio, beta * rejected_ratio,
                            policy_chosen_logps, policy_rejected_logps)
    return PreferenceLoss(losses, metrics=metrics)


# --------------------------------------------------------------------------------------------
# ORPO and SimPO (reference-free)
# --------------------------------------------------------------------------------------------

def _nll_term(chosen_logps: torch.Tensor, chosen_tokens: torch.Tensor, weight: float,
              nll_logps: torch.Tensor | None, nll_tokens: torch.Tensor | None):
    """(weighted summed NLL, token count): over the chosen completions unless given."""
    if nll_logps is None:
        nll_logps, nll_tokens = chosen_logps, chosen_tokens
    return -weight * nll_logps.sum(), nll_tokens.sum()


def orpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
              chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *,
              beta: float = ORPO_BETA, nll_logps: torch.Tensor | None = None,
              nll_tokens: torch.Tensor | None = None) -> PreferenceLoss:
    """Odds-ratio preference optimisation: SFT on the chosen completion plus an odds-ratio term.

    With a = the length-averaged completion log-prob, odds(y) = p / (1 - p) for p = exp(a), and
    log odds ratio r = (a_c - a_r) - (log(1 - exp(a_c)) - log(1 - exp(a_r))):

        loss = NLL (token mean) - beta * mean_pairs(log sigmoid(r))

    Args:
        chosen_logps, rejected_logps: [P] summed completion log-probs (with grad).
        chosen_tokens, rejected_tokens: [P] completion token counts.
        nll_logps, nll_tokens: [P] summed log-probs and counts of the tokens the NLL covers;
            None: the chosen completions' (leantune's choice). TRL 1.16's ORPOTrainer takes
            the NLL over the whole chosen sequence, prompt included: pass those to match it.

    Returns:
        PreferenceLoss: losses [P] = -beta log sigmoid(r), nll_sum / nll_tokens, and metrics
        rewards_* (beta * average log-prob), reward_margin, reward_accuracy, logps_*,
        log_odds_ratio (log sigmoid r) and log_odds_chosen (r), each [P].
    """
    beta = _check_beta(beta)
    avg_c = _average(chosen_logps.float(), chosen_tokens)
    avg_r = _average(rejected_logps.float(), rejected_tokens)
    log_odds = (avg_c - avg_r) - (log1m_exp(avg_c) - log1m_exp(avg_r))
    ratio = F.logsigmoid(log_odds)
    nll_sum, n_tok = _nll_term(chosen_logps.float(), chosen_tokens, 1.0, nll_logps, nll_tokens)
    metrics = _pair_metrics(beta * avg_c, beta * avg_r, chosen_logps, rejected_logps)
    metrics.update(log_odds_ratio=ratio.detach(), log_odds_chosen=log_odds.detach())
    return PreferenceLoss(-beta * ratio, nll_sum, n_tok, metrics)


def simpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
               chosen_tokens: torch.Tensor, rejected_tokens: torch.Tensor, *,
               beta: float = SIMPO_BETA, gamma: float = SIMPO_GAMMA, label_smoothing: float = 0.0,
               nll_weight: float = 0.0) -> PreferenceLoss:
    """Simple preference optimisation: a margin loss on length-averaged log-probs, no reference.

        loss = -(1 - eps) log sigmoid(beta (a_c - a_r) - gamma) - eps log sigmoid(-(...))
               + nll_weight * NLL of the chosen completions (token mean)

    TRL runs this as CPOTrainer(loss_type="simpo"), whose config defaults are beta 0.1, gamma
    (simpo_gamma) 0.5 and an NLL weight (cpo_alpha) of 1.0, i.e. CPO-SimPO. The defaults here
    are TRL's beta 0.1 and gamma 0.5, without the NLL term (the SimPO paper's); the paper
    tunes beta in 2.0-2.5, where averaged log-probs' differences move the sigmoid more
    (`--beta 2`).

    Returns:
        PreferenceLoss: losses [P], the NLL term when nll_weight > 0, and metrics rewards_*
        (beta * average log-prob), reward_margin, reward_accuracy, logps_*, each [P].
    """
    beta = _check_beta(beta)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)) or not gamma >= 0:
        raise LeantuneError(f"--simpo-gamma must be a number >= 0, got {gamma!r}")
    avg_c = _average(chosen_logps.float(), chosen_tokens)
    avg_r = _average(rejected_logps.float(), rejected_tokens)
    losses = _smoothed_sigmoid_loss(avg_c - avg_r - gamma / beta, beta,
                                    _check_smoothing(label_smoothing))
    nll_sum = n_tok = None
    if nll_weight:
        nll_sum, n_tok = _nll_term(chosen_logps.float(), chosen_tokens, float(nll_weight),
                                   None, None)
    metrics = _pair_metrics(beta * avg_c, beta * avg_r, chosen_logps, rejected_logps)
    return PreferenceLoss(losses, nll_sum, n_tok, metrics)


# --------------------------------------------------------------------------------------------
# KTO (unpaired)
# --------------------------------------------------------------------------------------------

def kto_kl(policy_kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """KTO's reference point: the batch mean of policy - reference log-probs of mismatched
    (prompt, other row's completion) sequences, clamped at 0, detached. Scalar fp32.

    Under data parallelism TRL averages the per-process means before clamping: reduce the
    unclamped mean ``(policy_kl_logps - ref_kl_logps).mean()`` across processes, then clamp."""
    return (policy_kl_logps.float() - ref_kl_logps.float()).mean().detach().clamp(min=0)


def kto_loss(policy_logps: torch.Tensor, ref_logps: torch.Tensor, desirable: torch.Tensor, *,
             kl: torch.Tensor | None = None, beta: float = KTO_BETA,
             desirable_weight: float = 1.0, undesirable_weight: float = 1.0) -> PreferenceLoss:
    """Kahneman-Tversky optimisation on unpaired rows labelled desirable or not.

    With r = policy - reference summed log-probs of a row and z = `kl` (`kto_kl`; 0 when None):

        desirable     desirable_weight   * (1 - sigmoid(beta (r - z)))
        undesirable   undesirable_weight * (1 - sigmoid(beta (z - r)))

    Args:
        policy_logps, ref_logps: [R] summed completion log-probs (policy with grad).
        desirable: [R] bool, the row's label.
        kl: scalar reference point (detached), or None for 0.

    Returns:
        PreferenceLoss with losses [R] (in row order; their mean is TRL's loss) and metrics
        rewards [R] (beta * r), desirable [R] (1.0 / 0.0), logps [R], kl (scalar).
    """
    beta = _check_beta(beta)
    desirable = desirable.to(torch.bool)
    z = torch.zeros((), device=policy_logps.device) if kl is None else kl.detach()
    ratio = policy_logps - ref_logps
    want = 1.0 - torch.sigmoid(beta * (ratio - z))
    avoid = 1.0 - torch.sigmoid(beta * (z - ratio))
    losses = torch.where(desirable, desirable_weight * want, undesirable_weight * avoid)
    metrics = {"rewards": (beta * ratio).detach(), "desirable": desirable.float(),
               "logps": policy_logps.detach(), "kl": z}
    return PreferenceLoss(losses, metrics=metrics)
