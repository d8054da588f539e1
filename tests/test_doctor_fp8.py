"""doctor's fp8 line and the refusal it shares with `train --precision fp8`: no FP8 matrix units
(the CPU, GPUs before sm_89) is one line naming the way out, unless emulation is asked."""

import torch

from leantune.doctor import NO, OK, fp8_path
from leantune.kernels.fp8 import fp8_unsupported


def test_cpu_is_refused_unless_emulating(monkeypatch):
    monkeypatch.delenv("LEANTUNE_FP8_EMULATE", raising=False)
    mark, detail = fp8_path("cpu")
    assert mark == NO and "LEANTUNE_FP8_EMULATE=1" in detail and "\n" not in detail
    monkeypatch.setenv("LEANTUNE_FP8_EMULATE", "1")
    assert fp8_path("cpu")[0] == OK and fp8_unsupported(torch.device("cpu")) is None


def test_gpus_before_sm89_are_refused(monkeypatch):
    monkeypatch.delenv("LEANTUNE_FP8_EMULATE", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA A100")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (8, 0))
    why = fp8_unsupported(torch.device("cuda"))
    assert "A100 (sm_80) has no FP8 matrix units" in why and "--precision bf16" in why
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *_: (9, 0))
    assert fp8_unsupported(torch.device("cuda")) is None
    assert fp8_path("cuda")[0] == OK
