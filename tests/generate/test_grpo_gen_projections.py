"""The decode step's projections (generate/projections.py): "packed" and "precast" give what the
model's own forward ("plain") gives, in fewer kernels; a step kept for reuse sees the adapter as
trained since it was made. (GRPO's rollouts: the trainer's engine has packed the weights.)"""

from __future__ import annotations

import collections

import pytest
import torch
from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401  (autouse)
from torch.utils._python_dispatch import TorchDispatchMode

import leantune.generate.decode as D
from leantune.engine import Engine, LayerPlan
from leantune.generate.projections import DecodeProjections
from leantune.generate.sampling import Sampling

CPU = torch.device("cpu")
PROMPTS = [[5, 6, 7], [8, 9, 10, 11, 12], [3, 4]]


def packed_model(family: str, targets=None):
    """A tiny fp32 model whose weights a trainer's engine packed (LoRA columns in the GEMM)."""
    model = model_for(CONFIGS[family], targets=targets)
    engine = Engine()
    engine.attach(model, [LayerPlan(2)] * len(model.layers))
    engine.pack(model)
    return model.eval()


def step_logits(model, mode: str, steps: int = 3) -> list[torch.Tensor]:
    """The prefill's and `steps` decode steps' logits through a DecodeStep in `mode`."""
    step = D.DecodeStep(model, len(PROMPTS), 32, CPU, False, projections=mode)
    step.proj.refresh()
    P = max(map(len, PROMPTS))
    ids = torch.zeros(len(PROMPTS), P, dtype=torch.long)
    for r, p in enumerate(PROMPTS):
        ids[r, P - len(p):] = torch.tensor(p)
    cache = step.cache
    cache.pad.copy_(torch.tensor([P - len(p) for p in PROMPTS]))
    with torch.no_grad(), step.proj.installed():
        pos, meta = cache.meta(P)
        out = [model.forward_cached(ids, pos, meta)]
        for i in range(steps):
            cache.start.fill_(P + i)
            out.append(step(model, out[-1].argmax(-1)).clone())
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "gelu"])
def test_packed_and_precast_steps_equal_the_plain_step(family):
    model = packed_model(family)
    ref = step_logits(model, "plain")
    for mode in ("packed", "precast"):
        got = step_logits(model, mode)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert DecodeProjections(model, "packed").packed_groups == 3 * len(model.layers)
    assert DecodeProjections(model, "precast").packed_groups == 0


def test_partial_targets_and_no_engine_fall_back_per_group():
    model = packed_model("llama", targets=["q_proj", "v_proj", "down_proj"])
    ref = step_logits(model, "plain")
    for a, b in zip(step_logits(model, "packed"), ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    bare = model_for(CONFIGS["llama"]).eval()  # no engine: every adapted projection precast
    proj = DecodeProjections(bare, "packed")
    assert proj.packed_groups == 0 and len(proj.forwards) == 7 * len(bare.layers)
    for a, b in zip(step_logits(bare, "packed"), step_logits(bare, "plain")):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_sampled_completions_are_the_same_in_every_mode():
    model = packed_model("qwen3")
    runs = {mode: [d.token_ids for d in D.decode(model, PROMPTS, 8, Sampling(
        temperature=1.0, top_p=0.9, seed=7), projections=mode)] for mode in
        ("plain", "precast", "packed")}
    assert runs["packed"] == runs["plain"] == runs["precast"]
    assert all(not hasattr(m, "forward") or "forward" not in m.__dict__
               for m in model.modules())  # forwards removed after the decode


def test_a_kept_step_sees_the_adapter_as_trained_since():
    """The graphed step is kept between calls (on the CPU its capture fails: eager replays of the
    same kept buffers); after an optimizer step its buffers must hold the new adapter."""
    model = packed_model("llama")
    notes = []
    try:
        first = D._step_for(model, len(PROMPTS), 256, CPU, True, notes.append, "packed")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.add_(torch.randn_like(p), alpha=0.3)  # "trained", in place
        assert D._step_for(model, len(PROMPTS), 256, CPU, True, None, "packed") is first
        orig = D._step_for
        D._step_for = lambda *a: first  # as on CUDA: decode reuses the kept step
        try:
            got = D.decode(model, PROMPTS, 6, cuda_graphs=True)
        finally:
            D._step_for = orig
        ref = D.decode(model, PROMPTS, 6, projections="plain")
        assert [d.token_ids for d in got] == [d.token_ids for d in ref]
        for a, b in zip(step_logits(model, "packed"), step_logits(model, "plain")):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    finally:
        D._GRAPHED.pop(model, None)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name == "_to_copy" and args[0].requires_grad:  # (a LoRA parameter)
            self.ops["adapter casts"] += 1
        return func(*args, **(kwargs or {}))


def test_packed_step_runs_fewer_gemms_and_no_adapter_casts():
    """bf16 base under fp32 LoRA masters (the trainer's layout): per layer the plain step casts
    14 adapter tensors and runs 21 GEMMs; the packed one casts none and runs 9."""
    model = packed_model("llama")
    for n, p in model.named_parameters():
        if "lora_" not in n:
            p.data = p.data.to(torch.bfloat16)
    engine = Engine()  # re-pack in bf16
    engine.attach(model, [LayerPlan(2)] * len(model.layers))
    engine.pack(model)
    counts = {}
    for mode in ("plain", "packed"):
        step = D.DecodeStep(model, 2, 16, CPU, False, projections=mode)
        step.proj.refresh()
        step.cache.start.fill_(3)
        with torch.no_grad(), step.proj.installed(), _Count() as c:
            step(model, torch.tensor([5, 6]))
        counts[mode] = c.ops
    L = len(model.layers)
    gemms = {m: c["mm"] + c["addmm"] + c["addmm_"] for m, c in counts.items()}
    assert gemms["plain"] - gemms["packed"] == 12 * L
    assert counts["plain"]["adapter casts"] == 14 * L
    assert counts["packed"]["adapter casts"] == 0


def test_compiled_layers_keep_the_plain_path():
    model = packed_model("llama")
    model.layers[0]._compiled_call_impl = lambda *a, **k: None  # as nn.Module.compile leaves it
    proj = DecodeProjections(model, "packed")
    layer0 = model.layers[0]
    mods = {id(m) for m, _ in proj.forwards}
    assert not mods & {id(m) for m in layer0.modules()}
    assert proj.packed_groups == 3 * (len(model.layers) - 1)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "phi3"])
def test_packed_steps_equal_plain_on_the_new_families_with_rslora(name, tmp_path):
    """Gemma's (1 + w) norms, soft-caps and GeGLU, Gemma 3 multimodal's prefixed weights and
    Phi-3's fused checkpoint tensors: packed decode projections still give the plain step
    (rsLoRA scaling inside the packed LoRA columns); with LoRA dropout nothing is packed."""
    import leantune
    from leantune import LoRAConfig, apply_lora

    from test_new_families_cli import _checkpoint  # (tests/ is on the path, as for helpers)

    _checkpoint(name, tmp_path / name)
    for dropout in (0.0, 0.1):
        model = leantune.load_model(tmp_path / name, device="cpu", dtype=torch.float32)
        apply_lora(model, LoRAConfig(r=4, alpha=8, use_rslora=True, dropout=dropout), seed=0)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)
        engine = Engine()
        engine.attach(model, [LayerPlan(2)] * len(model.layers))
        engine.pack(model)
        model.eval()
        groups = DecodeProjections(model, "packed").packed_groups
        assert groups == (3 * len(model.layers) if dropout == 0 else 0)
        for a, b in zip(step_logits(model, "packed"), step_logits(model, "plain")):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
