"""Writing what the ecosystem reads: merged Hugging Face checkpoints (GGUF comes later)."""

from .merge import export_merged

__all__ = ["export_merged"]
