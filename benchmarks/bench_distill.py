"""On-policy distillation LoRA seconds per update: retrograd vs TRL's DistillationTrainer, interleaved and checked.

A by-hand benchmark, not a test. Same student, teacher, prompts and settings on both sides:

  student     SmolLM2-135M-Instruct, retrograd's built-in GGUF (Q4_1, de-quantized to fp32): retrograd's
              [model] path is the .gguf (its conversion cache, warmed by the prepare step), TRL loads it
              with transformers' from_pretrained(gguf_file=...), as benchmarks/bench_grpo.py does
  teacher     the same SmolLM2 with its output head untied and scaled by 1.25 (the base model at
              temperature 0.8: a fixed teacher at a clear KL distance from the start), saved once by the
              prepare step as a plain fp32 HF folder that both sides load with from_pretrained
  LoRA        r=8, alpha=16, dropout 0, q_proj, k_proj, v_proj, o_proj; lr 1e-4 constant, no warm-up,
              weight decay 0, grad-norm clip 1.0, AdamW; one optimizer step per update
  update      4 prompts x 1 completion (TRL's DistillationTrainer samples exactly one completion per
              prompt), at most 32 new tokens, temperature 1.0, top-p 1, top-k off, the student sampling
              fresh completions every update (fully on-policy on both sides), prompts in file order
  prompts     "What is a + b? Reply with only the number." (seed 0), the same rows in the same order
  other       fp32, no gradient checkpointing, 2 threads, seed 0; TRL generates with transformers'
              generate (no vLLM), retrograd with its own sampler. --smoke swaps the models for a tiny random
              Llama (hidden 32, 2 layers, byte-level tokenizer built here, teacher = its head x 3)

Options set on TRL's side (DistillationConfig, TRL 1.16; `trl.experimental.distillation` is, in 1.16, only
a deprecated alias of `trl.DistillationTrainer` / `trl.DistillationConfig`, so the stable classes are used:
the same code without the FutureWarning). DistillationTrainer has no off-policy mode: every update it
generates completions of the update's prompts with the student and trains on them (no lambda/mixing
knob exists in 1.16; with gradient_accumulation_steps=1 the buffered generation is used for exactly one
step). Set explicitly: beta=1.0 (the reverse KL(student || teacher); its default is 1.0 too),
temperature=1.0 (sampling and loss), top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
max_completion_length=32, per_device_train_batch_size=4, gradient_accumulation_steps=1,
use_vllm=False, shuffle_dataset=False (file order, like retrograd's prompt_order = "sequential"),
pad_to_multiple_of=None, gradient_checkpointing=False and bf16=False (TRL's defaults are True for both),
learning_rate=1e-4 (default 1e-6), lr_scheduler_type="constant", warmup_steps=0, weight_decay=0,
max_grad_norm=1.0, optim="adamw_torch", disable_dropout=True, use_cpu=True, logging_steps=1.

WHERE THE OBJECTIVES DIFFER (written down, not hidden; the timing compares the two as shipped):
  retrograd  [distill] mode = "on_policy": per sampled token a_t = clamp(log p_T(y_t) - log p_S(y_t),
             +-5 nats), fed as a per-token advantage to the clipped surrogate (one epoch: ratio 1, the
             0.2/0.28 clip inactive); loss = -mean_t a_t (token mean over the update's completion
             tokens). Its gradient, -mean_t a_t grad log p_S(y_t), is a one-sample (sampled-token)
             estimate of the reverse KL's gradient. Per update: teacher forward (no grad), a student
             forward without grad (the "old" log-probs the advantages and the ratio use), then the
             student forward + backward. Its logged loss equals distill/teacher_kl_mean, the sampled-token
             KL estimate, whenever no token hit the +-5 clamp (checked below).
  TRL        beta=1.0: the exact reverse KL(p_S || p_T) summed over the FULL vocabulary at every completion
             position (chunked over the vocabulary), mean over the completion tokens, no clamp, no ratio;
             the gradient flows through all V student logits of every position (on CPU TRL projects
             every position of the right-padded completion block, padding included, then masks; on
             CUDA only the real ones). Per update: teacher forward (no grad) and the student forward +
             backward; no extra student pass.
  Both score only the completion tokens (the EOS included, the prompt not), at temperature 1, and neither
  credits a token for its effect on later positions. Same sampled sequences would give the same expected
  per-token KL; the per-step gradients differ (one-sample vs exact over the vocabulary, clamp).

Fairness and checks: the two sides run in separate processes, interleaved (rg, TRL, rg, TRL, ...; --repeats
each, default 3), the load average recorded before each; reported is the median over the repeats of each
run's mean seconds per update (updates 2+; update 1 is warm-up), with the spread (min-max), and the ratio
TRL/retrograd. The script stops unless, for every run: each update sampled 4 completions of 1..32 tokens
and trained all of them (TRL: the loss averages over exactly the sampled completion tokens; retrograd: its
train/tokens is exactly its completion tokens plus the prompt tokens TRL counted for the same update's
prompts), one optimizer step per update, --steps updates at the constant lr, and the same prompts every
update on both sides. It also checks each side's logged loss against its own objective: TRL's update-1
loss is recomputed as the exact full-vocabulary reverse KL of the base student (adapter disabled; LoRA
B = 0 before the first step) vs the teacher on the update-1 completions; retrograd's loss must equal its
sampled-token KL estimate on every update where no token was clamped. Sampled tokens per update are
logged for both sides, and seconds per 1k completion tokens is reported next to seconds per update (the
two samplers draw different completions, so the lengths differ).
The retrograd side runs the real CLI (`python -m retrograd train run.toml`) and reads metrics.jsonl and
completions.jsonl; TRL's side times steps with a TrainerCallback and splits out generation with TRL's own
profiling spans. Also recorded: CPU model, this machine's fp32 and bf16 matmul GFLOP/s, versions.

    pip install -e '.[bench]'
    python benchmarks/bench_distill.py [--steps 6] [--repeats 3] [--out benchmarks/results]
    python benchmarks/bench_distill.py --smoke --out /tmp/bench_distill   # tiny random models, ~1 minute

Writes OUT/distill_<timestamp>.json (OUT/distill_smoke_<timestamp>.json with --smoke).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_sft  # noqa: E402
import common  # noqa: E402
from bench_grpo import bf16_matmul_gflops, matmul_gflops, matmul_params, median_spread  # noqa: E402
from bench_sft import (LORA_ALPHA, LORA_R, LORA_TARGETS, THREADS, cpu_model,  # noqa: E402
                       load_trl_model, self_peak_rss_mb, versions, write_json)

PROMPTS, GENS, MAX_NEW, LR, SEED, CTX = 4, 1, 32, 1e-4, 0, 256
WEIGHT_CLIP = 5.0
SHARPEN, SMOKE_SHARPEN = 1.25, 3.0  # the teacher: the student's head x this (the base at temperature 1/x)
LOSS_TOLERANCE = 1e-4
HIGHER_IS_BETTER = ("sampling_tokens_per_s", "sampling_share_of_matmul_peak")
REPO = Path(__file__).resolve().parent.parent


def write_prompts(path: Path, n: int) -> None:
    rng = random.Random(SEED)
    rows = []
    for _ in range(n):
        a, b = rng.randint(2, 60), rng.randint(2, 60)
        rows.append({"prompt": [{"role": "user", "content": f"What is {a} + {b}? Reply with only the number."}],
                     "answer": a + b})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


# ---- models -----------------------------------------------------------------------------------------

CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
                 " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def tiny_tokenizer():
    """Byte-level BPE with no merges (256 byte tokens + specials) and a ChatML template, built offline
    (as tests/tiny.py make_tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<|endoftext|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def tiny_student(path: Path) -> Path:
    """A random Llama (hidden 32, 2 layers) with the tiny tokenizer, as an HF folder."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    tok = tiny_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def sharpened_teacher(student_folder: Path, path: Path, sharpen: float) -> Path:
    """`student_folder`'s model with its output head untied and scaled by `sharpen` (the model at
    temperature 1/sharpen), fp32, with the student's tokenizer files: an HF folder both sides load."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(str(student_folder), dtype=torch.float32)
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=False)
    with torch.no_grad():
        head.weight.copy_(model.get_output_embeddings().weight * sharpen)
    model.config.tie_word_embeddings = False
    model.lm_head = head
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(str(student_folder)).save_pretrained(path)
    return path


def load_student_trl(path: str):
    """(model, tokenizer) for TRL: a .gguf de-quantized to fp32 (as bench_grpo), or an HF folder in fp32."""
    if path.endswith(".gguf"):
        return load_trl_model(path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return model, tok


# ---- workers (each in its own process) ---------------------------------------------------------------

def worker_prepare(args) -> dict:
    """The student (fetch the built-in GGUF and warm retrograd's conversion cache, as bench_sft's
    prepare step; or a tiny random model with --smoke) and the teacher folder. Not measured."""
    import torch
    work = Path(args.work)
    if args.smoke:
        student = str(tiny_student(work / "tiny-student"))
        folder, sharpen, extra = student, SMOKE_SHARPEN, {}
    else:
        from retrograd.models.load import _converted_gguf
        extra = bench_sft.worker_prepare(args)  # {"gguf", "gguf_bytes", "retrograd_load_s"}
        student = extra["gguf"]
        folder, _ = _converted_gguf(Path(student).resolve(), torch.float32, print)
        sharpen = SHARPEN
    teacher = sharpened_teacher(Path(folder), work / "teacher", sharpen)
    from transformers import AutoModelForCausalLM
    n = matmul_params(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    return {**extra, "student": student, "student_folder": folder, "teacher": str(teacher),
            "teacher_sharpen": sharpen, "matmul_params": n}


def run_toml(args, work: Path) -> str:
    return f"""\
[run]
algorithm = "distill"
name = "bench_distill"
directory = {json.dumps(str(work / "run"))}

[model]
path = {json.dumps(args.student)}
device = "cpu"
dtype = "float32"

[output]
path = {json.dumps(str(work / "adapter"))}

[lora]
rank = {LORA_R}
alpha = {LORA_ALPHA}
targets = {json.dumps(LORA_TARGETS)}
dropout = 0.0
seed = {SEED}

[training]
trainable = "lora"
lr = {LR}
lr_scheduler = "constant"
warmup_steps = 0
weight_decay = 0.0
max_grad_norm = 1.0
ctx = {CTX}
seed = {SEED}
threads = {THREADS}
gradient_checkpointing = false

[distill]
mode = "on_policy"
teacher_path = {json.dumps(args.teacher)}
prompts = {json.dumps(args.data)}
updates = {args.steps}
prompts_per_update = {PROMPTS}
samples_per_prompt = {GENS}
distill_epochs = 1
clip_range_low = 0.2
clip_range_high = 0.28
weight_clip = {WEIGHT_CLIP}
kl_coefficient = 0.0
mask_truncated = false
prompt_order = "sequential"
log_completions_every = 1

[distill.sampling]
max_new_tokens = {MAX_NEW}
temperature = 1.0
top_p = 1.0
top_k = 0
seed = {SEED}
dtype = "auto"

[metrics]
log_every = 1
"""


def worker_retrograd(args) -> dict:
    """The real CLI: `python -m retrograd train run.toml`; then its metrics.jsonl and completions.jsonl."""
    work = Path(args.work)
    toml = run_toml(args, work)
    (work / "run.toml").write_text(toml)
    proc = subprocess.run([sys.executable, "-m", "retrograd", "train", str(work / "run.toml")], check=False, cwd=work,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if proc.returncode != 0:
        raise SystemExit(f"bench_distill: `retrograd train` failed (exit {proc.returncode})")
    cli_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "system/step_seconds" in r]
    logged = [json.loads(x) for x in (work / "run" / "completions.jsonl").read_text(encoding="utf-8").split("\n") if x]
    per_step = defaultdict(list)
    for c in logged:
        per_step[c["step"]].append(c)
    steps = [r["step"] for r in rows]
    return {"step_s": [r["system/step_seconds"] for r in rows], "sampling_s": [r["time/sampling_s"] for r in rows],
            "training_s": [r["time/training_s"] for r in rows],
            "completion_tokens": [[c["tokens"] for c in per_step[s]] for s in steps],
            "prompts": [[c["prompt"] for c in per_step[s]] for s in steps],
            "forward_tokens": [r["train/tokens"] for r in rows],  # prompt + completion tokens of the trained rows
            "optimizer_steps": sum(1 for r in rows if "optimizer/grad_norm" in r),
            "loss": [r["train/loss"] for r in rows],
            "teacher_kl_estimate": [r.get("distill/teacher_kl_mean") for r in rows],
            "clamped_fraction": [r.get("distill/advantage_clipped_fraction") for r in rows],
            "lr": [r.get("optimizer/lr") for r in rows],
            "cli_peak_rss_mb": cli_peak, "run_toml": toml}


def worker_trl(args) -> dict:
    import torch
    import trl.extras.profiling as prof
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback, set_seed
    from trl import DistillationConfig, DistillationTrainer
    torch.set_num_threads(THREADS)
    set_seed(SEED)
    spans = defaultdict(list)
    original = prof.ProfilingContext._log_metrics

    def capture(self, duration):  # TRL's own profiling spans (generate, compute_loss, ...)
        spans[self.name.split(".", 1)[-1]].append(duration)
        return original(self, duration)
    prof.ProfilingContext._log_metrics = capture

    rows = [json.loads(x) for x in Path(args.data).read_text().splitlines() if x.strip()]
    model, tok = load_student_trl(args.student)
    tok.padding_side = "left"
    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.step_s = []

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.step_s.append(time.perf_counter() - self._t)

    timer = StepTimer()
    cfg = DistillationConfig(
        output_dir=str(Path(args.work) / "trl_out"), max_steps=args.steps,
        per_device_train_batch_size=PROMPTS * GENS, gradient_accumulation_steps=1,
        # the objective: reverse KL(student || teacher) over the full vocabulary, at temperature 1
        beta=1.0, temperature=1.0,
        # on-policy sampling, as retrograd's [distill.sampling]
        max_completion_length=MAX_NEW, top_p=1.0, top_k=0, min_p=None, repetition_penalty=1.0,
        generation_kwargs=None, cache_implementation=None, use_vllm=False, shuffle_dataset=False,
        pad_to_multiple_of=None,
        # optimisation, as retrograd's [training]
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", disable_dropout=True,
        bf16=False, fp16=False, gradient_checkpointing=False, use_cpu=True, seed=SEED,
        dataloader_num_workers=0, remove_unused_columns=False, logging_steps=1, report_to="none",
        save_strategy="no", log_completions=False, disable_tqdm=True)
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    trainer = DistillationTrainer(model=model, teacher_model=teacher, args=cfg, train_dataset=Dataset.from_list(rows),
                                  processing_class=tok, peft_config=lora, callbacks=[timer])

    generated = []  # per update: prompts, completion lengths, tokens in the loss; update 1's tensors

    def record(inputs, _inner=trainer._generate_and_score_completions):
        out = _inner(inputs)
        generated.append({"prompts": [x["prompt"][-1]["content"] for x in inputs],
                          "completion_tokens": out["completion_mask"].sum(1).tolist(),
                          "prompt_tokens": out["prompt_mask"].sum(1).tolist(),
                          "num_items": int(out["num_items_in_batch"]),
                          "tensors": {k: out[k].detach().clone() for k in
                                      ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")}
                          if not generated else None})
        return out
    trainer._generate_and_score_completions = record
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x and "train_runtime" not in x]
    gen = spans.get("transformers.generate", [])
    return {"step_s": timer.step_s, "sampling_s": gen, "training_s": [t - g for t, g in zip(timer.step_s, gen)],
            "completion_tokens": [g["completion_tokens"] for g in generated],
            "prompts": [g["prompts"] for g in generated],
            "prompt_tokens": [g["prompt_tokens"] for g in generated],
            "loss_tokens": [g["num_items"] for g in generated],  # the tokens TRL's loss averages over
            "forward_tokens": [sum(g["prompt_tokens"]) + g["num_items"] for g in generated],
            "optimizer_steps": trainer.state.global_step,
            "loss": [x["loss"] for x in logs], "lr": [x.get("learning_rate") for x in logs],
            "update1_loss_recomputed": exact_reverse_kl(trainer, generated[0]["tensors"]) if generated else None,
            "trainer_class": f"{type(trainer).__module__}.{type(trainer).__qualname__}",
            "spans": {k: v for k, v in spans.items()}}


def exact_reverse_kl(trainer, t: dict) -> float:
    """KL(p_S || p_T) over the whole vocabulary, token mean over the completion, of the base student (the
    adapter disabled: what the student was at update 1, LoRA B = 0) vs the teacher on update 1's
    completions, with the inputs TRL used (left-padded prompts, right-padded completions, its mask)."""
    import torch
    ids = torch.cat([t["prompt_ids"], t["completion_ids"]], 1)
    att = torch.cat([t["prompt_mask"], t["completion_mask"]], 1)
    k, mask = t["completion_ids"].size(1), t["completion_mask"].float()
    model = trainer.model
    model.eval()
    with torch.no_grad():
        with model.disable_adapter():
            s = model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1][:, -k:].float()
        tl = trainer.teacher_model(input_ids=ids, attention_mask=att, use_cache=False).logits[:, :-1][:, -k:].float()
    ls, lt = torch.log_softmax(s / trainer.temperature, -1), torch.log_softmax(tl / trainer.temperature, -1)
    kl = (ls.exp() * (ls - lt)).sum(-1)
    return float((kl * mask).sum() / mask.sum())


WORKERS = {"prepare": worker_prepare, "retrograd": worker_retrograd, "trl": worker_trl}


# ---- parent ------------------------------------------------------------------------------------------

def spawn(kind: str, work: Path, args, data: Path, prep: dict | None = None) -> dict:
    """Run `this script --worker kind` in its own process; its result JSON plus the process's own peak RSS
    (wait4's rusage covers the worker and the children it waited for: retrograd's CLI process)."""
    work.mkdir(parents=True, exist_ok=True)
    result = work / "result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", kind, "--steps", str(args.steps),
           "--work", str(work), "--data", str(data), "--result", str(result)]
    if prep:
        cmd += ["--student", prep["student"], "--teacher", prep["teacher"]]
    if args.smoke:
        cmd.append("--smoke")
    load = os.getloadavg()
    print(f"\n=== {kind}  (load average {' '.join(f'{x:.2f}' for x in load)})", flush=True)
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, env={**os.environ, **bench_sft.CHILD_ENV}, cwd=REPO)
    _, status, usage = os.wait4(proc.pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"bench_distill: the {kind} worker failed (exit {os.waitstatus_to_exitcode(status)}); see above")
    out = json.loads(result.read_text())
    out.update(process_wall_s=time.perf_counter() - t, process_peak_rss_mb=usage.ru_maxrss / 1024,
               process_cpu_s=usage.ru_utime + usage.ru_stime, load_average_before=load)
    return out


def check_same_work(kind: str, r: dict, steps: int) -> list[str]:
    """Stop unless every update trained all completions, one optimizer step each, on the stated objective.
    Returns notes on objective checks that could not run."""
    def fail(msg):
        raise SystemExit(f"bench_distill: {kind}: {msg}")
    for key in ("step_s", "sampling_s", "completion_tokens", "prompts", "forward_tokens", "loss"):
        if len(r[key]) != steps:
            fail(f"{len(r[key])} entries of {key} for {steps} updates")
    if r["optimizer_steps"] != steps:
        fail(f"{r['optimizer_steps']} optimizer steps for {steps} updates")
    for u, lengths in enumerate(r["completion_tokens"], 1):
        if len(lengths) != PROMPTS * GENS:
            fail(f"update {u} sampled {len(lengths)} completions, not {PROMPTS * GENS}")
        if not all(1 <= n <= MAX_NEW for n in lengths):
            fail(f"update {u}: completion lengths {lengths} outside 1..{MAX_NEW}")
        if kind == "trl" and r["loss_tokens"][u - 1] != sum(lengths):
            fail(f"update {u}: the loss averaged over {r['loss_tokens'][u - 1]} tokens of {sum(lengths)} sampled")
    if any(lr is not None and abs(lr - LR) > 1e-12 for lr in r["lr"]):
        fail(f"learning rates {r['lr']} are not the constant {LR}")
    notes = []
    if kind == "trl":
        got, want = r["loss"][0], r["update1_loss_recomputed"]
        if abs(got - want) > LOSS_TOLERANCE * max(1.0, abs(want)):
            fail(f"update-1 loss {got:.6f}, but the exact full-vocabulary reverse KL of its completions is "
                 f"{want:.6f}: not the objective stated in the docstring")
    else:
        checked = 0
        for u, (loss, est, clamped) in enumerate(zip(r["loss"], r["teacher_kl_estimate"], r["clamped_fraction"]), 1):
            if clamped == 0 and est is not None:
                checked += 1
                if abs(loss - est) > LOSS_TOLERANCE * max(1.0, abs(est)):
                    fail(f"update {u}: loss {loss:.6f} but the sampled-token KL estimate is {est:.6f} (no token "
                         "clamped): not the objective stated in the docstring")
        if not checked:
            notes.append(f"{kind}: every update had clamped tokens; the loss = KL-estimate check did not run")
    return notes


def check_same_prompts(rg: dict, trl: dict) -> None:
    """The same prompts every update, rendered to the same number of tokens; and retrograd trained every
    sampled completion: its forward tokens are exactly its completions' plus TRL's prompt tokens."""
    for u, (pa, pb) in enumerate(zip(rg["prompts"], trl["prompts"]), 1):
        if sorted(pa) != sorted(pb):
            raise SystemExit(f"bench_distill: update {u} used different prompts: {pa} vs {pb}")
        prompt_tokens = rg["forward_tokens"][u - 1] - sum(rg["completion_tokens"][u - 1])
        if prompt_tokens != sum(trl["prompt_tokens"][u - 1]):
            raise SystemExit(f"bench_distill: update {u}: retrograd trained {rg['forward_tokens'][u - 1]} tokens, "
                             f"which is not its {sum(rg['completion_tokens'][u - 1])} completion tokens + the "
                             f"{sum(trl['prompt_tokens'][u - 1])} prompt tokens of the update's prompts (TRL): "
                             "not every completion was trained, or the prompts were rendered differently")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, help="updates per run (default 6; 2 with --smoke)")
    p.add_argument("--repeats", type=int, help="runs of each side, interleaved (default 3; 1 with --smoke)")
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--smoke", action="store_true", help="tiny random models instead of SmolLM2: checks the "
                   "script end to end in about a minute; the timings mean nothing")
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    for internal in ("--work", "--data", "--result", "--student", "--teacher"):
        p.add_argument(internal, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        out = WORKERS[args.worker](args)
        out["worker_peak_rss_mb"] = self_peak_rss_mb()
        write_json(Path(args.result), out)
        return
    args.steps = args.steps or int(os.environ.get("STEPS", "2" if args.smoke else "6"))
    args.repeats = args.repeats or (1 if args.smoke else 3)
    if args.steps < 2:
        p.error("--steps must be at least 2 (update 1 is warm-up and is left out)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if os.getloadavg()[0] > 2:
        print(f"WARNING: load average {os.getloadavg()[0]:.2f} > 2; other processes will distort the timings",
              flush=True)
    peak, peak_bf16 = matmul_gflops(), bf16_matmul_gflops()
    runs: dict[str, list[dict]] = {"retrograd": [], "trl": []}
    notes: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench_distill-") as tmp_name:
        tmp = Path(tmp_name)
        data = tmp / "prompts.jsonl"
        write_prompts(data, max(32, args.steps * PROMPTS))
        prep = spawn("prepare", tmp / "prepare", args, data)
        for i in range(args.repeats):  # A B A B ...: drift of the machine hits both sides alike
            for kind in ("retrograd", "trl"):
                r = spawn(kind, tmp / f"{kind}-{i}", args, data, prep)
                notes += check_same_work(kind, r, args.steps)
                runs[kind].append(r)
            check_same_prompts(runs["retrograd"][-1], runs["trl"][-1])
    n_matmul = prep["matmul_params"]
    summary = {}
    for kind, rs in runs.items():
        per_run = []
        for r in rs:
            k = slice(1, None)  # update 1 is warm-up

            def mean(key, r=r, k=k):
                return sum(r[key][k]) / len(r[key][k])
            sampled = [sum(x) for x in r["completion_tokens"][k]]
            tps = sum(sampled) / sum(r["sampling_s"][k])
            per_run.append({"s_per_update": mean("step_s"), "sampling_s": mean("sampling_s"),
                            "training_s": mean("training_s"),
                            "s_per_1k_completion_tokens": 1000 * sum(r["step_s"][k]) / sum(sampled),
                            "sampled_tokens_per_update": sum(sampled) / len(sampled),
                            "sampling_tokens_per_s": tps,
                            "sampling_share_of_matmul_peak": tps * 2 * n_matmul / 1e9 / peak,
                            "peak_rss_mb": max(r["process_peak_rss_mb"], r["worker_peak_rss_mb"])})
        summary[kind] = {key: dict(zip(("median", "min", "max"), median_spread([x[key] for x in per_run])))
                         for key in per_run[0]}
        summary[kind]["update1_loss"] = [r["loss"][0] for r in rs]
    model = "tiny random Llama (smoke)" if args.smoke else "SmolLM2-135M"
    print(f"\nOn-policy distillation LoRA r={LORA_R} q,k,v,o | {model}, teacher = its head x {prep['teacher_sharpen']} | "
          f"{PROMPTS} prompts x {GENS} completion x <= {MAX_NEW} tokens | {args.steps} updates (mean of 2+), median "
          f"of {args.repeats} interleaved runs (min-max) | {THREADS} threads | {cpu_model()} | matmul fp32 "
          f"{peak:.0f}, bf16 {peak_bf16:.0f} GFLOP/s")
    print(f"\n  {'':<32} {'retrograd':>24}   {'TRL':>24}   ratio")
    ratios = {}
    for key in summary["retrograd"]:
        if key == "update1_loss":
            continue
        a, b = summary["retrograd"][key], summary["trl"][key]
        higher_is_better = key in HIGHER_IS_BETTER
        ratio = (a["median"] / b["median"] if higher_is_better else b["median"] / a["median"]) \
            if a["median"] and b["median"] else float("nan")
        ratios[f"{key} ({'retrograd/TRL' if higher_is_better else 'TRL/retrograd'})"] = ratio
        print(f"  {key:<32} {a['median']:10.4g} ({a['min']:.4g}-{a['max']:.4g})   {b['median']:10.4g} "
              f"({b['min']:.4g}-{b['max']:.4g})   {ratio:5.2f}x")
    print("\n(ratio: TRL/retrograd for seconds, memory and sampled tokens, retrograd/TRL for tokens/s and the "
          "matmul share: above 1, retrograd is faster / smaller. Both sides trained all "
          f"{PROMPTS * GENS} completions of every update, one optimizer step each, on the same prompts; the "
          "objectives differ as the docstring says: retrograd a clamped sampled-token reverse-KL estimate, TRL the "
          "exact full-vocabulary reverse KL)")
    print(f"update-1 loss: retrograd {summary['retrograd']['update1_loss']} (sampled-token estimate), "
          f"TRL {summary['trl']['update1_loss']} (exact)")
    for n in notes:
        print("note:", n)
    name = out_dir / f"distill{'_smoke' if args.smoke else ''}_{time.strftime('%Y%m%d_%H%M%S')}.json"
    write_json(name, {"summary": summary, "ratios": ratios, "raw": runs, "prepare": prep,
                      "notes": notes, "matmul_gflops": peak, "matmul_gflops_bf16": peak_bf16, "versions": versions(),
                      "cpu": cpu_model(), "machine": common.machine({"fp32": peak, "bf16": peak_bf16}),
                      "steps": args.steps, "repeats": args.repeats, "smoke": args.smoke,
                      "settings": {"prompts_per_update": PROMPTS, "completions_per_prompt": GENS,
                                   "max_new_tokens": MAX_NEW, "lr": LR, "seed": SEED, "ctx": CTX,
                                   "weight_clip": WEIGHT_CLIP, "threads": THREADS,
                                   "lora": {"r": LORA_R, "alpha": LORA_ALPHA, "targets": LORA_TARGETS}}})
    print(f"wrote {name}")


if __name__ == "__main__":
    main()
