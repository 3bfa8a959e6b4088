"""Tiny random models and data for tests: built from a config here, never downloaded.

The tokenizer is byte-level (256 byte tokens + specials) with a ChatML template, so chat
rendering, loss masks and saving behave like a real model's, in a few KB.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def make_tokenizer(merges: tuple[str, ...] = (), split_digits: bool = False, pre_tokenizer=None):
    """`merges` ("a b" pairs) add merged tokens after the 256 bytes; `split_digits` puts SmolLM2's
    digit-by-digit split before the byte-level step; `pre_tokenizer` replaces the whole step."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    byte_chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for m in merges:
        vocab[m.replace(" ", "")] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_digits:
        tk.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), tk.pre_tokenizer])
    if pre_tokenizer is not None:
        tk.pre_tokenizer = pre_tokenizer
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_model_dir(path: Path, seed: int = 0, hidden: int = 32, layers: int = 2, tie: bool = True,
                   tokenizer=None, max_positions: int = 512) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tokenizer or make_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=tie, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def random_lora(model_dir: Path, seed: int = 0):
    """(the loaded model at `model_dir`, it with a LoRA r=4 on every linear layer whose B is random, not
    PEFT's zeros): an adapter that changes the outputs, so every LoRA tensor gets a gradient."""
    import torch
    from retrograd.models.load import load_model
    from retrograd.models.lora import attach_lora
    loaded = load_model(str(model_dir), log=lambda *_: None)
    model, _ = attach_lora(loaded.model, 4, 8, ["auto"], 0.0, 0)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    return loaded, model


WORDS = "red green blue cat dog sun moon tree fish bird rock star".split()


def chat_rows(n: int, seed: int = 0) -> list[dict]:
    """Learnable conversations: the answer repeats the question's words in reverse order."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        rows.append({"messages": [{"role": "user", "content": " ".join(words)},
                                  {"role": "assistant", "content": " ".join(reversed(words))}]})
    return rows


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_run(tmp: Path, model_dir: Path, extra: str = "", *, steps: int | None = 8, train_rows: int = 24,
              eval_rows: int = 8, name: str = "run.toml") -> Path:
    """A small SFT run.toml in `tmp` (data written beside it)."""
    write_jsonl(tmp / "train.jsonl", chat_rows(train_rows, seed=1))
    write_jsonl(tmp / "eval.jsonl", chat_rows(eval_rows, seed=2))
    text = f"""
[run]
algorithm = "sft"
[model]
path = "{model_dir}"
[output]
path = "out/adapter"
[lora]
rank = 4
alpha = 8
dropout = 0.1
[training]
lr = 0.01
batch_size = 2
gradient_accumulation = 2
ctx = 64
threads = 1
{f"max_steps = {steps}" if steps else ""}
[sft]
data = "train.jsonl"
"""
    cfg = tmp / name
    cfg.write_text(_merge(text, extra))
    return cfg


def _merge(base: str, extra: str) -> str:
    """Merge `extra` TOML lines into `base`: keys replace keys of the same table, new tables append."""
    import re
    tables: dict[str, dict[str, str]] = {}
    for text in (base, extra):
        table = ""
        for line in text.strip().splitlines():
            m = re.match(r"^\[(.+)\]$", line.strip())
            if m:
                table = m.group(1)
                tables.setdefault(table, {})
            elif "=" in line:
                tables.setdefault(table, {})[line.split("=", 1)[0].strip()] = line
    return "".join(f"\n[{t}]\n" + "\n".join(kv.values()) + "\n" for t, kv in tables.items())


class CLI:
    """Runs `python -m retrograd ...` in a folder, the way a user runs the command."""

    def __init__(self, cwd: Path):
        self.cwd = cwd

    def __call__(self, *args, env=None, check=None, timeout=300):
        full_env = {**os.environ, **(env or {})}
        proc = subprocess.run([sys.executable, "-m", "retrograd", *map(str, args)], cwd=self.cwd, env=full_env,
                              capture_output=True, text=True, timeout=timeout)
        if check is not None:
            assert proc.returncode == check, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        return proc


def pref_rows(n: int, seed: int = 0) -> list[dict]:
    """Learnable pairs: the chosen answer reverses the question's words, the rejected one repeats them."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        words = rng.sample(WORDS, 3)
        rows.append({"prompt": [{"role": "user", "content": " ".join(words)}],
                     "chosen": [{"role": "assistant", "content": " ".join(reversed(words))}],
                     "rejected": [{"role": "assistant", "content": " ".join(words)}]})
    return rows


def write_pref_run(tmp: Path, model_dir: Path, extra: str = "", *, steps: int | None = 8, train_rows: int = 24,
                   eval_rows: int = 8, name: str = "pref.toml") -> Path:
    """A small preference run.toml in `tmp` (pairs written beside it)."""
    write_jsonl(tmp / "pairs.jsonl", pref_rows(train_rows, seed=1))
    write_jsonl(tmp / "pairs_eval.jsonl", pref_rows(eval_rows, seed=2))
    text = f"""
[run]
algorithm = "preference"
[model]
path = "{model_dir}"
[output]
path = "out/adapter"
[lora]
rank = 4
alpha = 8
[training]
lr = 0.01
batch_size = 2
gradient_accumulation = 2
ctx = 64
threads = 1
{f"max_steps = {steps}" if steps else ""}
[preference]
data = "pairs.jsonl"
"""
    cfg = tmp / name
    cfg.write_text(_merge(text, extra))
    return cfg


def write_grpo_run(tmp: Path, model_dir: Path, extra: str = "", *, updates: int = 6, name: str = "grpo.toml") -> Path:
    """A small GRPO run.toml in `tmp`: prompts plus a python reward (the share of lowercase ASCII
    letters in the completion, which a tiny random model learns to raise within a few updates)."""
    write_jsonl(tmp / "prompts.jsonl", [{"prompt": [{"role": "user", "content": w}], "answer": w} for w in WORDS])
    (tmp / "tiny_rewards.py").write_text(
        "def share_of_lowercase(prompts, completions, **columns):\n"
        "    return [sum('a' <= ch <= 'z' for ch in c) / max(1, len(c)) for c in completions]\n")
    text = f"""
[run]
algorithm = "grpo"
[model]
path = "{model_dir}"
[output]
path = "out/adapter"
[lora]
rank = 4
alpha = 8
[training]
lr = 0.02
ctx = 64
threads = 1
[grpo]
prompts = "prompts.jsonl"
updates = {updates}
prompts_per_update = 2
group_size = 4
rewards = [{{ type = "python", function = "tiny_rewards:share_of_lowercase" }}]
[grpo.sampling]
max_new_tokens = 8
seed = 3
"""
    cfg = tmp / name
    cfg.write_text(_merge(text, extra))
    return cfg


def write_ppo_run(tmp: Path, model_dir: Path, extra: str = "", *, updates: int = 6, name: str = "ppo.toml") -> Path:
    """A small PPO run.toml in `tmp`, with the GRPO run's prompts and lowercase-share reward."""
    write_grpo_run(tmp, model_dir, updates=1)  # writes prompts.jsonl and tiny_rewards.py
    text = f"""
[run]
algorithm = "ppo"
[model]
path = "{model_dir}"
[output]
path = "out/adapter"
[lora]
rank = 4
alpha = 8
[training]
lr = 0.02
ctx = 64
threads = 1
[ppo]
prompts = "prompts.jsonl"
updates = {updates}
rollout_batch_size = 8
ppo_epochs = 2
rewards = [{{ type = "python", function = "tiny_rewards:share_of_lowercase" }}]
[ppo.sampling]
max_new_tokens = 8
seed = 3
[ppo.critic]
value_lr = 0.05
"""
    cfg = tmp / name
    cfg.write_text(_merge(text, extra))
    return cfg


def make_teacher_dir(path: Path, student_dir: Path, sharpen: float = 3.0) -> Path:
    """A tiny model with `student_dir`'s tokenizer: that model at temperature 1 / `sharpen` (its head
    untied and scaled). Distillation tests use a sharpened copy of a random model as the student (a
    peaked distribution, as a real LM has) and a sharper copy of it as the teacher: a target the
    student can reach, at a clear distance at the start."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(student_dir)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight * sharpen)
    model.config.tie_word_embeddings = False
    model.lm_head = head
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(student_dir).save_pretrained(path)
    return path


def write_distill_run(tmp: Path, model_dir: Path, teacher_dir: Path, extra: str = "", *, mode: str = "on_policy",
                      updates: int = 8, name: str = "distill.toml") -> Path:
    """A small distillation run.toml in `tmp`: on_policy samples the GRPO run's prompts; topk_offline
    reads the SFT run's chat rows and the teacher's top-k in teacher.topk."""
    write_grpo_run(tmp, model_dir, updates=1)  # prompts.jsonl
    write_run(tmp, model_dir)  # train.jsonl, eval.jsonl
    mode_keys = (f'prompts = "prompts.jsonl"\nupdates = {updates}\nprompts_per_update = 4\nsamples_per_prompt = 2\n'
                 if mode == "on_policy" else 'data = "train.jsonl"\nsidecar = "teacher.topk"\noffline_epochs = 2\n')
    text = f"""
[run]
algorithm = "distill"
[model]
path = "{model_dir}"
[output]
path = "out/adapter"
[lora]
rank = 4
alpha = 8
[training]
lr = 0.02
ctx = 64
threads = 1
batch_size = 4
[distill]
mode = "{mode}"
teacher_path = "{teacher_dir}"
{mode_keys}"""
    if mode == "on_policy":
        text += "[distill.sampling]\nmax_new_tokens = 8\nseed = 3\n"
    cfg = tmp / name
    cfg.write_text(_merge(text, extra))
    return cfg
