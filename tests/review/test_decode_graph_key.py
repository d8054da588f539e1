"""Review finding: the CUDA-graphed decode step kept for a model's next decode call (decode.py
_step_for) is keyed by the switches baked into the captured graph (FP8 packing, FP8 head), but
not by LEANTUNE_DECODE_ATTENTION: switched between two calls in one process, the second call
replays the graph captured with the other attention path (the switch does not switch). The key
is checked on the CPU: _step_for makes no graph until the step runs."""

import torch

from helpers import CONFIGS, model_for
from leantune.generate import decode as decode_module


def test_the_kept_graph_step_follows_the_decode_attention_switch(monkeypatch):
    model = model_for(CONFIGS["llama"]).eval()
    dev = torch.device("cpu")
    monkeypatch.setattr(decode_module, "_GRAPHED", decode_module.weakref.WeakKeyDictionary())
    monkeypatch.setenv("LEANTUNE_DECODE_ATTENTION", "1")
    on = decode_module._step_for(model, 2, 32, dev, True, None)
    assert decode_module._step_for(model, 2, 32, dev, True, None) is on  # (kept: same switches)
    monkeypatch.setenv("LEANTUNE_DECODE_ATTENTION", "0")
    off = decode_module._step_for(model, 2, 32, dev, True, None)
    assert off is not on
