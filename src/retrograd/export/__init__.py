"""Exporters: llama.cpp GGUF LoRA adapters (more formats come with the interop work)."""
