"""A trained model whose base is an HF folder, written as a standalone llama.cpp GGUF (no llama.cpp
converter): llama.cpp tokenizes text as the HF tokenizer does (GPT-2 and SmolLM2 digit-split
pre-tokenizers, merges, special tokens) and gives the PyTorch model's next-token log-probabilities,
for a merged LoRA (f32 / f16 / q8_0), an untied head, and a full fine-tune written by `train`."""
import json
import random

import pytest
import torch

from llamacpp_util import next_token_logprobs
from retrograd.errors import ConfigError
from retrograd.export.gguf_merged import write_model_gguf
from retrograd.models.load import load_model
from retrograd.models.lora import attach_lora
from tiny import make_model_dir, make_tokenizer, write_run

MERGES = ("1 2", "Ġ c", "Ġc a", "a b")


def ascii_prompt(model, tok, rng):
    """Text (with digits and merged pairs) whose most likely next token is printable ASCII: llama.cpp's
    server holds back a token that is an incomplete UTF-8 byte."""
    for _ in range(300):
        text = " ".join(rng.choice(["ca", "ab", "12", "1212", "cab", "x7", "<|im_start|>"]) for _ in range(5))
        ids = tok(text).input_ids
        with torch.no_grad():
            ref = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
        out = tok.decode([int(ref.argmax())])
        if len(out) == 1 and 32 <= ord(out) < 127:
            return text, ids, ref
    raise AssertionError("no prompt with an ASCII next token")


def max_diff(got, ref):
    assert len(got) == 20
    return max(abs(v - float(ref[i])) for i, v in got.items())


@pytest.mark.parametrize("split_digits,tie", [(False, True), (True, False)])
def test_lora_merged_gguf_from_hf_folder_matches_torch(tmp_path, split_digits, tie):
    folder = make_model_dir(tmp_path / "model", tie=tie, tokenizer=make_tokenizer(MERGES, split_digits))
    loaded = load_model(str(folder))
    model, tok = loaded.model, loaded.tokenizer
    assert len(tok("1212").input_ids) == (4 if split_digits else 2)  # "12" is a merged token
    model, _ = attach_lora(model, 4, 8, ["auto"], 0.0, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    lora = {"rank": 4, "alpha": 8}
    paths = {d: write_model_gguf(str(folder), model, tok, lora, tmp_path / f"m-{d}.gguf", d)
             for d in ("f32", "f16", "q8_0")}
    assert "lora_A" in "".join(n for n, _ in model.named_parameters())  # the live model is not merged

    text, ids, ref = ascii_prompt(model, tok, random.Random(1))
    with torch.no_grad(), model.disable_adapter():
        base = torch.log_softmax(model(input_ids=torch.tensor([ids])).logits[0, -1], -1)
    assert float((ref - base).abs().max()) > 0.1  # the LoRA matters

    by_text = next_token_logprobs(paths["f32"], text)
    by_ids = next_token_logprobs(paths["f32"], ids)
    assert by_text == by_ids  # llama.cpp tokenized the text exactly like the HF tokenizer
    assert max_diff(by_text, ref) < 1e-4
    assert max_diff(next_token_logprobs(paths["f16"], ids), ref) < 2e-2
    q8 = next_token_logprobs(paths["q8_0"], ids)
    assert max(q8, key=q8.get) == int(ref.argmax())

    import gguf
    fields = gguf.GGUFReader(str(paths["f32"])).fields
    assert fields["tokenizer.ggml.pre"].contents() == ("smollm" if split_digits else "gpt-2")
    assert fields["tokenizer.chat_template"].contents() == tok.chat_template
    assert fields["tokenizer.ggml.eos_token_id"].contents() == tok.eos_token_id


def test_full_fine_tune_of_an_hf_folder_trains_into_a_gguf(tmp_path, cli):
    folder = make_model_dir(tmp_path / "model", tie=False, tokenizer=make_tokenizer(MERGES))
    cfg = write_run(tmp_path, folder, """
[output]
path = "out/model.gguf"
[training]
trainable = "full"
lr = 0.003
[checkpoint]
directory = "ckpt"
mode = "steps"
every_steps = 4
""", steps=4)
    cfg.write_text(cfg.read_text().replace("[lora]\nrank = 4\nalpha = 8\ndropout = 0.1\n", ""))
    cli("train", cfg, check=0)
    from retrograd.export.from_checkpoint import load_checkpoint_model
    model, tok, lora, _ = load_checkpoint_model(tmp_path / "ckpt" / "step-000000000004.state", log=lambda *_: None)
    assert lora is None
    text, ids, ref = ascii_prompt(model, tok, random.Random(2))
    assert max_diff(next_token_logprobs(tmp_path / "out" / "model.gguf", text), ref) < 1e-4
    cli("export", tmp_path / "ckpt" / "step-000000000004.state", "--format", "gguf-merged", "--out",
        tmp_path / "again.gguf", check=0)
    assert max_diff(next_token_logprobs(tmp_path / "again.gguf", ids), ref) < 1e-4


def test_a_tokenizer_llamacpp_cannot_reproduce_is_refused_before_training(tmp_path, cli):
    from tokenizers import pre_tokenizers
    folder = make_model_dir(tmp_path / "model", tokenizer=make_tokenizer(pre_tokenizer=pre_tokenizers.Whitespace()))
    cfg = write_run(tmp_path, folder, '[output]\npath = "out/model.gguf"\nkind = "model"', steps=1)
    proc = cli("train", cfg, check=2)
    assert "no llama.cpp counterpart" in proc.stderr and "out/model.gguf" in proc.stderr
    assert not (tmp_path / "out").exists()
    tj = json.loads((folder / "tokenizer.json").read_text())
    tj["model"]["byte_fallback"] = True
    from retrograd.export.gguf_from_hf import pre_tokenizer_name
    with pytest.raises(ConfigError, match="byte-level BPE tokenizers only"):
        pre_tokenizer_name(tj)
