"""GRPO losses (train/losses/grpo.py) against TRL's GRPOTrainer._compute_loss on the same
tensors in fp32: its per-token log-probs are fed in (the model call is replaced), so the loss
and its gradient with respect to the log-probs must agree for every loss type, with and without
old log-probs (num_iterations > 1), the KL term, and over accumulated micro-batches."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from leantune.train.losses import grpo as L

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

N, C, G, MAXC = 6, 7, 3, 9


def _tensors(seed: int):
    g = torch.Generator().manual_seed(seed)
    logps = (-torch.rand(N, C, generator=g) * 3).requires_grad_(True)
    old = logps.detach() + 0.3 * torch.randn(N, C, generator=g)
    ref = logps.detach() + 0.2 * torch.randn(N, C, generator=g)
    lengths = torch.tensor([7, 3, 5, 1, 6, 4])
    mask = (torch.arange(C)[None] < lengths[:, None]).float()
    adv = torch.randn(N, generator=g)
    return logps, old, ref, mask, adv


def _trl_trainer(loss_type: str, beta: float, eps: float, eps_high: float, ga: int):
    """A GRPOTrainer with only what _compute_loss reads (no model, no data)."""
    t = trl_grpo.GRPOTrainer.__new__(trl_grpo.GRPOTrainer)
    level = "sequence" if loss_type == "gspo" else "token"
    t.__dict__.update(
        loss_type="grpo" if loss_type == "gspo" else loss_type, beta=beta, epsilon_low=eps,
        epsilon_high=eps_high, importance_sampling_level=level, top_entropy_quantile=1.0,
        off_policy_mask_threshold=None, use_vllm=False, vllm_importance_sampling_correction=False,
        aux_loss_enabled=False, _entropy_bonus_enabled=False, max_completion_length=MAXC,
        current_gradient_accumulation_steps=ga, model=SimpleNamespace(training=True),
        args=SimpleNamespace(delta=None, use_bias_correction_kl=False, steps_per_generation=ga),
        accelerator=SimpleNamespace(num_processes=1, gather=lambda x: x,
                                    reduce=lambda x, reduction="sum": x,
                                    gather_for_metrics=lambda x: x),
        _metrics={"train": __import__("collections").defaultdict(list)})
    return t


def _trl_loss(t, logps, old, ref, mask, adv, items):
    t._get_per_token_logps_and_entropies = lambda *a, **k: (logps, torch.zeros_like(logps), None)
    inputs = {"prompt_ids": torch.zeros(logps.shape[0], 1, dtype=torch.long),
              "prompt_mask": torch.ones(logps.shape[0], 1, dtype=torch.long),
              "completion_ids": torch.zeros(logps.shape, dtype=torch.long),
              "completion_mask": mask, "advantages": adv,
              "num_items_in_batch": torch.tensor(float(items))}
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    return t._compute_loss(None, inputs)


@pytest.mark.parametrize("loss_type", L.LOSS_TYPES)
@pytest.mark.parametrize("with_old, beta", [(False, 0.0), (True, 0.0), (True, 0.04)])
def test_loss_equals_trl(loss_type, with_old, beta):
    eps, eps_high = (3e-4, 4e-4) if loss_type == "gspo" else (0.2, 0.28)
    logps, old, ref, mask, adv = _tensors(1)
    old = old if with_old else None
    ref = ref if beta else None
    tl = L.token_loss(logps, old, adv, mask, loss_type=loss_type, epsilon_low=eps,
                      epsilon_high=eps_high, beta=beta, ref_logps=ref)
    n = L.normaliser(loss_type, N, int(mask.sum()), 1)
    ours = L.reduce(tl.per_token, mask, loss_type, MAXC) / n
    (g_ours,) = torch.autograd.grad(ours, logps)
    theirs = _trl_loss(_trl_trainer(loss_type, beta, eps, eps_high, 1), logps, old, ref, mask,
                       adv, mask.sum())
    (g_theirs,) = torch.autograd.grad(theirs, logps)
    assert math.isclose(ours.item(), theirs.item(), rel_tol=1e-6, abs_tol=1e-7)
    torch.testing.assert_close(g_ours, g_theirs, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("loss_type", L.LOSS_TYPES)
def test_accumulated_window_equals_trl(loss_type):
    """Two micro-batches of one window (TRL: gradient accumulation 2, the generation batch the
    window): the sum of our numerators over the window's normaliser is TRL's summed loss."""
    parts = [_tensors(s) for s in (2, 3)]
    tokens = int(sum(p[3].sum() for p in parts))
    n = L.normaliser(loss_type, 2 * N, tokens, 2)
    ours = theirs = 0
    t = _trl_trainer(loss_type, 0.0, 0.2, 0.2, 2)
    for logps, old, _, mask, adv in parts:
        tl = L.token_loss(logps, old, adv, mask, loss_type=loss_type)
        ours = ours + L.reduce(tl.per_token, mask, loss_type, MAXC) / n
        theirs = theirs + _trl_loss(t, logps, old, None, mask, adv, tokens)
    assert math.isclose(float(ours.detach()), float(theirs.detach()), rel_tol=1e-6, abs_tol=1e-7)


def test_group_advantages_match_trl_and_count_flat_groups():
    r = torch.tensor([1.0, 0.0, 1.0, 2.0, 2.0, 2.0, float("nan"), 0.5, 1.5])
    for scale in L.SCALE_REWARDS:
        a = L.group_advantages(r, 3, scale)
        mean = torch.nanmean(r.view(-1, 3), 1).repeat_interleave(3)
        std = (trl_grpo.nanstd(r.view(-1, 3), dim=1).repeat_interleave(3) if scale != "batch"
               else trl_grpo.nanstd(r).expand_as(r))
        want = r - mean
        if scale != "none":
            want = want / (std + 1e-4)
        torch.testing.assert_close(a.advantages, torch.nan_to_num(want, nan=0.0))
        assert a.zero_std_groups == 1 and torch.isfinite(a.advantages).all()
    flat = L.group_advantages(torch.full((6,), 0.7), 3)
    assert flat.zero_std_groups == 2 and (flat.advantages == 0).all()


def test_flat_groups_give_no_gradient_and_no_nan():
    logps, old, _, mask, _ = _tensors(4)
    adv = L.group_advantages(torch.ones(N), G).advantages
    for loss_type in L.LOSS_TYPES:
        tl = L.token_loss(logps, old, adv, mask * 0 if loss_type == "bnpo" else mask,
                          loss_type=loss_type)
        loss = L.reduce(tl.per_token, mask, loss_type, MAXC) / max(1, L.normaliser(
            loss_type, N, 0, 1))
        (g,) = torch.autograd.grad(loss, logps)
        assert loss.item() == 0 and torch.isfinite(g).all() and (g == 0).all()


def test_clip_metrics():
    logps, old, _, mask, adv = _tensors(5)
    tl = L.token_loss(logps, old, adv, mask, loss_type="dapo", epsilon_low=0.1)
    sums = L.masked_sums(tl, mask)
    m = mask.bool()
    assert sums["clip_low"] == (tl.clipped_low & m).sum() and sums["tokens"] == m.sum()
    assert sums["clip"] == sums["clip_low"] + sums["clip_high"] and sums["kl"] == 0
