"""The no-grad reference pass through the fused layers' forward (engine.fused_no_grad,
EngineOptions.fused_reference): the packed GEMMs run the base alone with the adapters switched
off, and give the plain layer path's reference log-probs (fp32, CPU; dense, q/k-norm and MoE
families; packed pairs and shared-prompt pairs); the adapters come back for the policy pass
(its loss and LoRA gradients are those of a step without a reference pass before it); the
switch off runs the plain path; generation's cached forward never takes the fused path."""

from types import SimpleNamespace

import pytest
import torch

from helpers import BASE, CONFIGS, model_for
from leantune.data.preference import PreferencePair
from leantune.engine import Engine, EngineOptions, FusedExecutor, LayerPlan, detach
from leantune.lora import adapters_disabled
from leantune.train.objectives.preference import DPOObjective, output_logps, reference_logps

FAMILIES = {"llama": CONFIGS["llama"], "qwen3": CONFIGS["qwen3"],
            "qwen3_moe": dict(BASE, model_type="qwen3_moe", num_experts=5,
                              num_experts_per_tok=2, moe_intermediate_size=24)}
PLANS = [LayerPlan(0), LayerPlan(1, offload=True), LayerPlan(2)]


def _pairs(seed=0):
    g = torch.Generator().manual_seed(seed)

    def ids(k):
        return torch.randint(3, 97, (k,), generator=g).tolist()

    return [PreferencePair(ids(5), ids(3), ids(4)), PreferencePair(ids(1), ids(6), ids(2)),
            PreferencePair(ids(7), ids(5), ids(5)), PreferencePair(ids(3), ids(1), ids(7))]


class _Items:
    def __init__(self, items):
        self.items, self.kind, self.pad_id, self.source = items, "pairs", 0, "<rows>"

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _objective(tmp_path):
    obj = SimpleNamespace(name="dpo", beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
                          simpo_gamma=None, desirable_weight=1.0, undesirable_weight=1.0,
                          precompute_reference=False, max_prompt_len=None)
    return DPOObjective(SimpleNamespace(objective=obj, max_seq_len=16, batch_size=8, seed=0,
                                        output=str(tmp_path), model="tiny", data=None),
                        log=lambda *a: None)


def _batch(obj, shared: bool):
    loader = obj.make_loader(_Items(_pairs()), None, shuffle=True)
    loader.shared_prompt = shared
    return loader.pack(list(range(len(_pairs()))))


def _count_fused_calls(monkeypatch):
    """A list that grows by one per fused layer call."""
    calls = []
    orig = FusedExecutor.__call__

    def call(self, *a, **k):
        calls.append(1)
        return orig(self, *a, **k)
    monkeypatch.setattr(FusedExecutor, "__call__", call)
    return calls


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("shared", [False, True])
def test_fused_reference_equals_the_plain_path(family, shared, tmp_path, monkeypatch):
    model = model_for(FAMILIES[family])
    obj = _objective(tmp_path)
    batch = _batch(obj, shared)
    plain = reference_logps(model, batch)  # (no executors: the plain path)
    Engine(EngineOptions()).attach(model, PLANS)
    calls = _count_fused_calls(monkeypatch)
    fused = reference_logps(model, batch)
    assert len(calls) == len(model.layers)  # every layer ran its fused forward
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)
    # the reference is the base: different from the policy's log-probs with LoRA on
    with torch.no_grad():
        on = output_logps(model(batch=batch.batch, token_logps=True), batch)
    assert (on - fused).abs().max() > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_policy_pass_after_a_fused_reference_pass_keeps_its_adapters(family, tmp_path):
    """The reference pass leaves the adapters' packed LoRA columns zeroed or stale; the policy
    pass after it must see s * B again: its DPO loss and LoRA gradients equal those of the
    same step with the plain reference path."""
    obj = _objective(tmp_path)
    results = {}
    for fused in (False, True):
        model = model_for(FAMILIES[family])
        Engine(EngineOptions(fused_reference=fused)).attach(model, PLANS)
        batch = _batch(obj, shared=True)
        model.zero_grad(set_to_none=True)
        out = obj.loss(model, batch)
        (out.loss_sum / batch.num_units).backward()
        results[fused] = (out.loss_sum.detach(),
                          {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None})
    (l0, g0), (l1, g1) = results[False], results[True]
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    assert set(g0) == set(g1) and g0
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-6, msg=n)


def test_the_switch_off_runs_the_plain_path(tmp_path, monkeypatch):
    model = model_for(CONFIGS["llama"])
    Engine(EngineOptions(fused_reference=False)).attach(model, PLANS)
    calls = _count_fused_calls(monkeypatch)
    reference_logps(model, _batch(_objective(tmp_path), shared=False))
    assert calls == []


def test_outside_the_block_no_grad_forwards_stay_plain(tmp_path, monkeypatch):
    """Evaluation and generation (KV cache) run no-grad forwards plainly; only the reference
    passes opt in."""
    from leantune.engine import fused_no_grad

    model = model_for(CONFIGS["llama"])
    Engine(EngineOptions()).attach(model, PLANS)
    calls = _count_fused_calls(monkeypatch)
    batch = _batch(_objective(tmp_path), shared=False).batch
    with torch.no_grad():
        model(batch=batch, token_logps=True)
    assert calls == []
    with torch.no_grad(), fused_no_grad(model), adapters_disabled(model):
        model(batch=batch, token_logps=True)
    assert len(calls) == len(model.layers)
    assert not any(layer.fused_no_grad for layer in model.layers)  # reset after the block
    detach(model)
    assert all(not isinstance(layer.executor, FusedExecutor) for layer in model.layers)
