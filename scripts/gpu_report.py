"""Helper of scripts/gpu_check.sh.

  python scripts/gpu_report.py model FOLDER       print the model to check with (see gpu_check.sh)
  python scripts/gpu_report.py report MODEL RUN...  tokens/s, MFU and peak GPU memory of each run folder

MFU counts 6 x parameters FLOPs per trained token for a full fine-tune and 4 x for LoRA (the frozen
weights need no weight gradient), plus attention, against the bf16 matmul peak measured here.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path


def pick_model(folder: Path) -> str:
    try:
        from retrograd.models.load import load_model  # finds the cached built-in, or fetches it
        load_model("smollm2-135m-instruct", log=lambda *_: None)
        return "smollm2-135m-instruct"
    except Exception as e:  # no network and no cache: the same shape, random weights
        print(f"built-in model unavailable ({type(e).__name__}); using a random model of its shape", file=sys.stderr)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from tiny import make_tokenizer
    tok = make_tokenizer()
    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    folder.mkdir(parents=True, exist_ok=True)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def bf16_peak_tflops() -> float:
    import torch
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t0, n = time.perf_counter(), 20
    for _ in range(n):
        a @ b
    torch.cuda.synchronize()
    return 2 * 8192 ** 3 * n / (time.perf_counter() - t0) / 1e12


def report(model: str, runs: list[str]) -> None:
    from retrograd.models.load import load_model
    loaded = load_model(model, log=lambda *_: None)
    n_params = sum(p.numel() for p in loaded.model.parameters())
    cfg = loaded.model.config
    peak = bf16_peak_tflops()
    print(f"GPU bf16 matmul peak measured: {peak:,.1f} TFLOP/s; model {n_params / 1e6:.1f}M parameters")
    for run in runs:
        rows = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        steps = [r for r in rows if "system/tokens_per_second" in r][2:] or [r for r in rows if "system/tokens_per_second" in r]
        if not steps:
            print(f"{run}: no training steps logged")
            continue
        tps = statistics.median(r["system/tokens_per_second"] for r in steps)
        config = (Path(run) / "config.toml").read_text()
        per_token = (4 if 'trainable = "lora"' in config else 6) * n_params \
            + 12 * cfg.num_hidden_layers * cfg.hidden_size * 256  # attention at ~256 tokens of context
        mfu = per_token * tps / (peak * 1e12)
        mem = max((r.get("system/gpu_memory_peak_mb", 0.0) for r in rows), default=0.0)
        print(f"{Path(run).name:>10}: {tps:,.0f} tokens/s  MFU {100 * mfu:.1f}%  peak GPU memory {mem:,.0f} MB  "
              f"({len(steps)} steps)")


if __name__ == "__main__":
    if sys.argv[1] == "model":
        print(pick_model(Path(sys.argv[2])))
    else:
        report(sys.argv[2], sys.argv[3:])
