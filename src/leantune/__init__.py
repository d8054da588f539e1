"""leantune: fast, memory-lean fine-tuning of open LLMs (LoRA and full; QLoRA next).

Python API:
    model = leantune.load_model("path/or/hub-id")          # our own model code, HF weights
    leantune.apply_lora(model, leantune.LoRAConfig(r=16))  # freeze base, add adapters
    leantune.save_adapter(model, "out")                    # PEFT format
    leantune.export_merged("base", "out", "merged")        # HF safetensors checkpoint
    leantune.generate(model, tokenizer, ["a prompt"])      # completions (leantune.generate)

The names are imported on first use, so `import leantune` (and the `leantune` command before it
starts working) does not wait for torch: `leantune --version` answers at once, and a Ctrl-C
while torch loads reaches the command's handler instead of ending in a traceback.
"""

from __future__ import annotations

import importlib

from .errors import LeantuneError

__version__ = "0.1.0"

_LAZY = {
    "PackedBatch": ".batch",
    "export_merged": ".export",
    "generate": ".generate",
    "LoRAConfig": ".lora",
    "apply_lora": ".lora",
    "load_adapter": ".lora",
    "save_adapter": ".lora",
    "ModelConfig": ".model.config",
    "load_model": ".model.loader",
    "CausalLM": ".model.transformer",
}

__all__ = ["LeantuneError", "__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'leantune' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
