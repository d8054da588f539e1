"""LoRA: the adaptable projection layer, adapter configuration, and PEFT-format I/O."""

from .config import ALL_TARGETS, TARGETS, LoRAConfig, apply_lora, lora_layers
from .layer import LoRALinear, adapters_disabled
from .peft_io import load_adapter, save_adapter

__all__ = ["ALL_TARGETS", "TARGETS", "LoRAConfig", "LoRALinear", "adapters_disabled", "apply_lora", "lora_layers",
           "load_adapter", "save_adapter"]
