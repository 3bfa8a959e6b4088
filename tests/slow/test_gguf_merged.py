"""`retrograd export --format gguf-merged` on a SmolLM2 LoRA checkpoint: llama.cpp running the
merged F32 GGUF gives the PyTorch merged model's next-token log-probabilities; Q8_0 loads and agrees
on the most likely token."""
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from llamacpp_util import next_token_logprobs

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "The capital of France is Paris. The capital of Germany is"
pytestmark = pytest.mark.slow


def run(*args, cwd):
    proc = subprocess.run([sys.executable, "-m", "retrograd", *map(str, args)], cwd=cwd, capture_output=True,
                          text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc


def test_merged_gguf_matches_torch(tmp_path, real_home, threads):
    cfg = tmp_path / "run.toml"
    shutil.copy(ROOT / "examples" / "quickstart.toml", cfg)
    run("train", cfg, "--threads", threads, "--set", "training.max_steps=2", "--set", "training.lr=0.01",
        "--set", "training.warmup_steps=0", "--set", "checkpoint.every_steps=2", "--set", "training.batch_size=2", "--set", "training.gradient_accumulation=1",
        "--set", "evaluation.max_examples=2", "--set", "lora.targets=['q', 'k', 'v']", cwd=tmp_path)
    state = tmp_path / "out" / "quickstart-checkpoints" / "step-000000000002.state"
    run("export", state, "--format", "gguf-merged", "--out", tmp_path / "merged-f32.gguf", cwd=tmp_path)
    run("export", state, "--format", "gguf-merged", "--dtype", "q8_0", "--out", tmp_path / "merged-q8.gguf",
        cwd=tmp_path)

    from retrograd.export.from_checkpoint import load_checkpoint_model
    model, tok, _, _ = load_checkpoint_model(state, log=lambda *_: None)
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        with model.disable_adapter():
            base = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
        ref = torch.log_softmax(model.merge_and_unload()(input_ids=ids).logits[0, -1], -1)
    assert float((ref - base).abs().max()) > 0.05  # the LoRA changes the output

    got = next_token_logprobs(tmp_path / "merged-f32.gguf", PROMPT)
    assert max(abs(v - float(ref[i])) for i, v in got.items()) < 1e-3
    q8 = next_token_logprobs(tmp_path / "merged-q8.gguf", PROMPT)
    assert max(q8, key=q8.get) == int(ref.argmax())
    assert (tmp_path / "merged-q8.gguf").stat().st_size < 0.4 * (tmp_path / "merged-f32.gguf").stat().st_size


def test_full_fine_tune_written_as_gguf(tmp_path, real_home, threads):
    cfg = tmp_path / "full.toml"
    cfg.write_text(f"""
[run]
algorithm = "sft"
[model]
path = "smollm2-135m-instruct"
[output]
path = "out/full.gguf"
[training]
trainable = "full"
lr = 1e-3
max_steps = 1
batch_size = 2
threads = {threads}
[sft]
data = "builtin:chat-sft"
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 1
""")
    run("train", cfg, cwd=tmp_path)
    from retrograd.export.from_checkpoint import load_checkpoint_model
    model, tok, lora, _ = load_checkpoint_model(tmp_path / "ckpt" / "step-000000000001.state", log=lambda *_: None)
    assert lora is None
    ids = tok(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
    from retrograd.models.load import load_model
    with torch.no_grad():
        base = torch.log_softmax(load_model("smollm2-135m-instruct").model(input_ids=ids).logits[0, -1], -1)
    assert float((ref - base).abs().max()) > 0.05  # the step really changed the weights
    got = next_token_logprobs(tmp_path / "out" / "full.gguf", PROMPT)
    assert max(abs(v - float(ref[i])) for i, v in got.items()) < 1e-3


def test_merged_gguf_from_an_hf_folder_base(tmp_path, real_home):
    """SmolLM2 saved as an HF folder: the merged LoRA is written from the folder's config + tokenizer;
    llama.cpp tokenizes the prompt like HF and gives the same logits."""
    from retrograd.export.gguf_merged import write_model_gguf
    from retrograd.models.load import load_model
    from retrograd.models.lora import attach_lora
    builtin = load_model("smollm2-135m-instruct", log=lambda *_: None)
    folder = str(tmp_path / "hf")
    builtin.model.save_pretrained(folder)
    builtin.tokenizer.save_pretrained(folder)
    del builtin
    loaded = load_model(folder, log=lambda *_: None)
    model, _ = attach_lora(loaded.model, 8, 16, ["q", "v"], 0.0, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    out = write_model_gguf(folder, model, loaded.tokenizer, {"rank": 8, "alpha": 16}, tmp_path / "m.gguf")
    ids = loaded.tokenizer(PROMPT + " 2024", return_tensors="pt").input_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
        with model.disable_adapter():
            base = torch.log_softmax(model(input_ids=ids).logits[0, -1], -1)
    assert float((ref - base).abs().max()) > 0.05
    by_text = next_token_logprobs(out, PROMPT + " 2024")
    assert by_text == next_token_logprobs(out, ids[0].tolist())
    assert max(abs(v - float(ref[i])) for i, v in by_text.items()) < 1e-3
