"""GGUF export without llama.cpp: own tensor mapping and quantisers on the `gguf` package's
file writer (pip install 'leantune[gguf]')."""

from .writer import GGUFExport, export_gguf, export_gguf_lora

__all__ = ["GGUFExport", "export_gguf", "export_gguf_lora"]
