"""Writing what the ecosystem reads: merged Hugging Face checkpoints, GGUF files (llama.cpp,
Ollama) and GGUF LoRA adapters."""

from .gguf import export_gguf, export_gguf_lora
from .merge import export_merged

__all__ = ["export_gguf", "export_gguf_lora", "export_merged"]
