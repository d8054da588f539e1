"""The speed bench's new shapes (Gemma 3 text, Phi-4): the transformers + PEFT baseline built
over leantune's weights and LoRA is the same model (Phi-3: fused qkv_proj / gate_up_proj), and
`bench/speed.py --tiny` runs the same code for every dense family on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import max_abs, one_torch_thread  # noqa: F401  (autouse)

from leantune import LoRAConfig, apply_lora
from leantune.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("shape", ["tiny-gemma3", "tiny-phi3"])
def test_hf_peft_twin_of_a_new_family(shape, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from harness import hf_peft_model, leantune_model

    base = leantune_model(shape, "cpu", dtype=torch.float32)
    apply_lora(base, LoRAConfig(r=4, alpha=8), seed=0)
    with torch.no_grad():
        for name, p in base.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)
    twin = hf_peft_model(shape, base, "cpu", gradient_checkpointing=False).eval()
    ids = torch.randint(0, 1000, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = base.eval()(ids).logits
        assert max_abs(twin(input_ids=ids).logits, ours) < 1e-4
        with twin.disable_adapter():
            assert max_abs(twin(input_ids=ids).logits, ours) > 1e-3


def test_real_shapes_read():
    sys.path.insert(0, str(ROOT / "bench"))
    from harness import hf_config

    g = ModelConfig.from_dict(hf_config("gemma-3-4b").to_dict())
    assert (g.hidden_size, g.num_hidden_layers, g.head_dim, g.vocab_size) == (2560, 34, 256,
                                                                              262208)
    assert [g.window_for_layer(i) for i in range(6)] == [1024] * 5 + [None]
    assert g.layer_rope["full_attention"][1]["factor"] == 8.0
    p = ModelConfig.from_dict(hf_config("phi-4").to_dict())
    assert (p.hidden_size, p.num_hidden_layers, p.num_attention_heads, p.num_key_value_heads,
            p.vocab_size, p.rotary_dim) == (5120, 40, 40, 10, 100352, None)


def test_speed_bench_tiny_runs_the_new_families(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path), PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, str(ROOT / "bench" / "speed.py"), "--tiny"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    table = res.stdout.strip().splitlines()[-4:]
    assert table[0].startswith("shape")
    assert [line.split()[0] for line in table[1:]] == ["tiny", "tiny-gemma3", "tiny-phi3"]
