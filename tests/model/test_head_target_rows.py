"""The LM head on the batch's target rows only (PackedBatch.target_rows, model._head_rows): the
loss sum, the per-token log-probs (0 off the targets) and every gradient equal the head over all
tokens (head_target_rows off), on the plain and the fused (Triton interpreter) paths."""

import pytest
import torch

from helpers import CONFIGS, model_for, one_torch_thread, packed_batch  # noqa: F401
from leantune import kernels
from leantune.batch import IGNORE_INDEX, PackedBatch
from leantune.engine import LayerPlan, attach, detach


def _run(model, batch, weights, on: bool):
    model.head_target_rows = on
    params = [p for p in model.parameters() if p.requires_grad]
    loss = model(batch=batch, loss_only=True).loss_sum
    g_loss = torch.autograd.grad(loss, params)
    logps = model(batch=batch, token_logps=True).token_logps
    g_logp = torch.autograd.grad((weights * logps).sum(), params)
    return loss.detach(), logps.detach(), torch.cat([g.flatten() for g in g_loss + g_logp])


def test_target_rows_are_the_labels_kept_and_travel_with_the_batch():
    batch = packed_batch()
    flat = batch.labels.flatten()
    assert batch.target_rows.tolist() == (flat != IGNORE_INDEX).nonzero()[:, 0].tolist()
    assert 0 < batch.target_rows.numel() < flat.numel()
    moved = batch.to("cpu")
    assert torch.equal(moved.target_rows, batch.target_rows)
    # a hand-built batch with host labels derives them
    fields = {k: v for k, v in vars(batch).items() if k != "target_rows"}
    assert torch.equal(PackedBatch(**fields).target_rows, batch.target_rows)
    # the model selects them (and not, switched off)
    model = model_for(CONFIGS["llama"])
    h = torch.zeros(*batch.input_ids.shape, model.config.hidden_size)
    assert torch.equal(model._head_rows(h, batch)[2], batch.target_rows)
    model.head_target_rows = False
    assert model._head_rows(h, batch)[2] is None


@pytest.mark.parametrize("fused", [False, True])
def test_head_on_target_rows_equals_head_on_every_token(fused):
    model = model_for(CONFIGS["llama"])
    batch = packed_batch()
    weights = torch.randn(batch.input_ids.numel(), generator=torch.Generator().manual_seed(3))
    if fused:
        attach(model, [LayerPlan(0), LayerPlan(1), LayerPlan(2)])
    else:
        detach(model)
    with kernels.backend("triton" if fused else "reference"):
        loss_all, logps_all, g_all = _run(model, batch, weights, on=False)
        loss_rows, logps_rows, g_rows = _run(model, batch, weights, on=True)
    torch.testing.assert_close(loss_rows, loss_all, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(logps_rows, logps_all, rtol=1e-6, atol=1e-6)
    assert (logps_rows[batch.labels.flatten() == IGNORE_INDEX] == 0).all()
    torch.testing.assert_close(g_rows, g_all, rtol=1e-5, atol=1e-6)
