"""Models: the built-in SmolLM2, loading from HF folders / GGUF files / aliases, LoRA."""
