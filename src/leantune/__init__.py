"""leantune: fast, memory-lean fine-tuning of open LLMs (LoRA, QLoRA, full).

Python API:
    model = leantune.load_model("path/or/hub-id")          # our own model code, HF weights
    leantune.apply_lora(model, leantune.LoRAConfig(r=16))  # freeze base, add adapters
    leantune.save_adapter(model, "out")                    # PEFT format
    leantune.export_merged("base", "out", "merged")        # HF safetensors checkpoint
"""

__version__ = "0.1.0"

from .batch import PackedBatch
from .errors import LeantuneError
from .export import export_merged
from .lora import LoRAConfig, apply_lora, load_adapter, save_adapter
from .model.config import ModelConfig
from .model.loader import load_model
from .model.transformer import CausalLM

__all__ = ["PackedBatch", "LeantuneError", "LoRAConfig", "apply_lora", "load_adapter",
           "save_adapter", "export_merged", "ModelConfig", "load_model", "CausalLM", "__version__"]
