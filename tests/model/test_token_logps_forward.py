"""The model's per-token log-prob forward (`model(batch=..., token_logps=True)`): the plain path
(autograd layers, reference head over full logits) and the fused path (engine executors, the
chunked Triton `token_logprobs` head through the interpreter) agree in fp32, forward and
backward with a per-token upstream gradient; and the log-probs are the loss's own terms."""

import pytest
import torch

from helpers import CONFIGS, model_for, one_torch_thread, packed_batch  # noqa: F401
from leantune import kernels
from leantune.batch import IGNORE_INDEX
from leantune.engine import LayerPlan, attach, detach


def _logps_and_grads(model, batch, weights):
    """(token log-probs [N], gradients of sum(weights * logps) w.r.t. the LoRA weights)."""
    logps = model(batch=batch, token_logps=True).token_logps
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad((weights * logps).sum(), params)
    return logps.detach(), torch.cat([g.flatten() for g in grads])


def test_token_logps_are_the_loss_terms_and_zero_off_target():
    model = model_for(CONFIGS["llama"])
    batch = packed_batch()
    with torch.no_grad(), kernels.backend("reference"):
        logps = model(batch=batch, token_logps=True).token_logps
        loss_sum = model.loss_sum(batch)
        logits = model(batch.input_ids, batch.position_ids).logits  # row 1 is one document
    assert logps.shape == (batch.input_ids.numel(),) and logps.dtype == torch.float32
    ignored = batch.labels.flatten() == IGNORE_INDEX
    assert ignored.any() and (logps[ignored] == 0).all() and (logps[~ignored] < 0).all()
    torch.testing.assert_close(-logps.sum(), loss_sum, rtol=1e-6, atol=1e-5)
    # the second row holds one document: its log-probs are the plain log_softmax's
    T = batch.input_ids.shape[1]
    lab = batch.labels[1]
    keep = lab != IGNORE_INDEX
    want = logits[1].float().log_softmax(-1)[keep].gather(1, lab[keep][:, None])[:, 0]
    torch.testing.assert_close(logps[T:][keep], want, rtol=1e-5, atol=1e-5)


def test_token_logps_need_a_packed_batch():
    model = model_for(CONFIGS["llama"])
    with pytest.raises(ValueError, match="token_logps needs a PackedBatch"):
        model(torch.zeros(1, 4, dtype=torch.long), token_logps=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_plain_and_fused_paths_agree(family):
    model = model_for(CONFIGS[family])
    batch = packed_batch()
    g = torch.Generator().manual_seed(1)
    weights = torch.randn(batch.input_ids.numel(), generator=g)  # a per-token upstream gradient
    detach(model)
    with kernels.backend("reference"):
        ref_logps, ref_grads = _logps_and_grads(model, batch, weights)
    attach(model, [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)])
    assert all(layer.executor is not None for layer in model.layers)
    with kernels.backend("triton"):
        logps, grads = _logps_and_grads(model, batch, weights)
        with torch.no_grad():  # the no-grad (reference-model) pass: same values
            nograd = model(batch=batch, token_logps=True).token_logps
    torch.testing.assert_close(logps, ref_logps, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nograd, ref_logps, rtol=1e-5, atol=1e-5)
    # (a summed, not averaged, objective: gradients ~50x the mean loss's, so atol scales too)
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-5)
    assert ref_grads.abs().max() > 0
