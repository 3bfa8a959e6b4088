"""retrograd: post-training for language models (SFT with LoRA or full weights, exact resume).

The engine is importable: ``retrograd.config.load_config``, ``retrograd.train.sft.train_sft``.
"""
__version__ = "0.1.0"
