"""The decode step that CUDA graphs capture: a capture that fails falls back to eager steps
with one note and the same tokens; graphed steps are kept per model for calls of the same
shapes and weights. (The capture itself needs a GPU: bench/generate_speed.py runs it.)"""

from __future__ import annotations

import torch
from helpers import CONFIGS, model_for, one_torch_thread  # noqa: F401  (autouse)

import leantune.generate.decode as decode_module
from leantune.generate.decode import DecodeStep, decode


def test_a_failed_capture_falls_back_to_eager_steps(monkeypatch):
    model = model_for(CONFIGS["qwen3"]).eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    ref = decode(model, prompts, 6)
    notes = []
    step = DecodeStep(model, 2, 16, torch.device("cpu"), graph=True, log=notes.append)
    monkeypatch.setattr(decode_module, "_step_for", lambda *a: step)  # as on CUDA

    def capture_fails(model):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(step, "_capture", capture_fails)
    got = decode(model, prompts, 6)
    assert [r.token_ids for r in got] == [r.token_ids for r in ref]
    assert notes == ["leantune: note: CUDA graph capture of the decode step failed (RuntimeError: "
                     "operation not permitted when stream is capturing); decoding without it "
                     "(slower)"]
    assert step.graph is None and not step.want_graph  # tried once, eager after


def test_graphed_steps_are_kept_for_the_same_shapes_and_weights():
    model = model_for(CONFIGS["llama"]).eval()
    cpu = torch.device("cpu")
    try:
        first = decode_module._step_for(model, 2, 256, cpu, True, None)
        assert decode_module._step_for(model, 2, 256, cpu, True, None) is first
        other = decode_module._step_for(model, 3, 256, cpu, True, None)
        assert other is not first and decode_module._GRAPHED[model][1] is other  # one kept
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.clone())
        assert decode_module._step_for(model, 3, 256, cpu, True, None) is not other
        assert decode_module._step_for(model, 3, 256, cpu, False, None) is not \
            decode_module._GRAPHED[model][1]  # eager steps are never kept
    finally:
        decode_module._GRAPHED.pop(model, None)
