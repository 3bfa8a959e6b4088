"""DPO LoRA throughput and peak memory: retrograd vs TRL's DPOTrainer in both of its reference modes.

A by-hand benchmark, not a test. Same model, data and settings on every side:

  model       SmolLM2-135M-Instruct, retrograd's built-in GGUF (Q4_1, de-quantized to fp32)
  LoRA        r=8, alpha=16, dropout 0, targets q_proj, k_proj, v_proj, o_proj
  loss        DPO (TRL loss_type ["sigmoid"]), beta 0.1, no label smoothing; the reference is the
              model as training starts, i.e. with the fresh adapter disabled
  batch       2 pairs per optimizer step, no accumulation; synthetic arithmetic pairs (a worked
              answer vs the same with a wrong sum), ~124 tokens per sequence, max length 256, pairs
              in file order; --epochs E: steps x 2 / E distinct pairs seen E times
  optimizer   AdamW (0.9/0.999, eps 1e-8), lr 5e-5 constant, clip 1.0; fp32, no gradient
              checkpointing, 2 threads, seed 0

Three sides, interleaved (retrograd, TRL, TRL precompute, retrograd, ...; --repeats each, default 3):

  retrograd       scores the reference once for every pair before step 1, never inside a step
  trl             precompute_ref_log_probs=False: a reference forward inside every step
  trl_precompute  precompute_ref_log_probs=True: TRL's own cached reference, the fair peer of
                  retrograd's (it runs in DPOTrainer's constructor; timed around that pass)

Figures, pairs per second (median and min-max over the runs):
  steady       steps 2+ only (step 1 is warm-up)
  end to end   one pass over the run: reference scoring (retrograd's "scoring the reference" ->
               "training " log lines; TRL precompute's pass; 0 for trl) + every step
  wall         as end to end, plus what each loop spends between its start and step 1 and between
               steps (TRL: trainer.train() start to the last step's end)
Every step's loss of every run must equal TRL's (reference in the step) first run within LOSS_TOL,
and each side's own first run within REPEAT_TOL, or the script stops.

    pip install -e '.[bench]'
    python benchmarks/bench_dpo.py [--steps 10] [--epochs 1] [--repeats 3] [--out benchmarks/results]
    python benchmarks/bench_dpo.py --smoke          # tiny random Llama, ~1.5-2 minutes, $TMPDIR/bench_out

Writes OUT/dpo_<timestamp>.json (dpo_smoke_... with --smoke) and prints the table report.py renders.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from bench_sft import (BUILTIN, LORA_ALPHA, LORA_R, LORA_TARGETS, add_common_args, prepare,  # noqa: E402
                       run_worker, worker_entry)
from common import THREADS, load_trl_model, self_peak_rss_mb, versions, write_json  # noqa: E402

PAIRS_PER_STEP, MAX_LEN, LR, BETA, SEED = 2, 256, 5e-5, 0.1, 0
MICRO_BATCH = 512  # retrograd's CPU default pass (tokens), written out
SMOKE = {"steps": 3, "repeats": 2, "lr": 5e-3}
SIDES = ("retrograd", "trl", "trl_precompute")
# The sides sum the same fp32 log-probs in different batch shapes (retrograd scores the reference in
# its own passes, through its fused head): the losses agreed to 4 decimals over 10 SmolLM2 steps,
# and to ~1e-6 in --smoke. 1e-3 relative is ~20x that, and any difference in the pairs, masking,
# beta or reference moves a DPO loss by far more.
LOSS_TOL = 1e-3
REPEAT_TOL = 1e-6  # the same side repeats its arithmetic bit for bit on CPU (checked in --smoke)


def make_pair(rng: random.Random) -> dict:
    a, b = rng.randint(100, 999), rng.randint(100, 999)
    bad = a + b + rng.choice([-100, -10, -1, 1, 10, 100])
    work = (f"Line the numbers up by place value and add column by column from the right, carrying "
            f"a ten into the next column whenever a column sum passes nine. As a check, {a + b} minus {b} "
            f"should give back {a}.")
    return {"prompt": [{"role": "user", "content": f"Add {a} and {b}. Show the method briefly, then state the sum."}],
            "chosen": [{"role": "assistant", "content": f"{work} The sum of {a} and {b} is {a + b}."}],
            "rejected": [{"role": "assistant", "content": f"{work} The sum of {a} and {b} is {bad}."}]}


def write_data(path: Path, n: int) -> None:
    rng = random.Random(SEED)
    path.write_text("".join(json.dumps(make_pair(rng)) + "\n" for _ in range(n)), encoding="utf-8")


def worker_retrograd(s: dict, work: Path) -> dict:
    common.start_like_the_cli()
    from retrograd.config import load_config
    from retrograd.train.preference import train_preference
    (work / "run.toml").write_text(f"""
[run]
algorithm = "preference"
name = "bench_dpo"
directory = {json.dumps(str(work / "run"))}
[model]
path = {json.dumps(s["model"])}
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
optimizer = "adamw"
lr = {s["lr"]}
lr_scheduler = "constant"
warmup_steps = 0
weight_decay = 0.0
adam_beta1 = 0.9
adam_beta2 = 0.999
adam_epsilon = 1e-8
max_grad_norm = 1.0
max_steps = {s["steps"]}
micro_batch = {MICRO_BATCH}
ctx = {MAX_LEN}
seed = {SEED}
threads = {THREADS}
gradient_checkpointing = false
[preference]
data = {json.dumps(s["data"])}
loss = "dpo"
beta = {BETA}
reference = "initial"
label_smoothing = 0.0
pairs_per_step = {PAIRS_PER_STEP}
shuffle = false
[metrics]
log_every = 1
""")
    events, t0 = [], time.perf_counter()

    def log(msg):
        events.append({"t": time.perf_counter() - t0, "wall": time.time(), "msg": str(msg)[:400],
                       "rss": self_peak_rss_mb()})
        print(msg, flush=True)

    train_preference(load_config(work / "run.toml"), log=log)
    t_score = next(e["t"] for e in events if e["msg"].startswith("scoring the reference"))
    train = next(e for e in events if e["msg"].startswith("training "))
    rows = [json.loads(x) for x in (work / "run" / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "preference/loss" in r]
    step_s = [r["system/step_seconds"] for r in rows]
    model_line = next(e for e in events if e["msg"].startswith("model "))
    trainable = re.search(r"([\d,]+) trainable", model_line["msg"])
    return {"step_s": step_s, "loss": [r["preference/loss"] for r in rows],
            "reward_accuracy": [r["preference/accuracy"] for r in rows], "reference_s": train["t"] - t_score,
            "loop_s": rows[-1]["time"] - train["wall"],  # loop start to the last step's metrics row (wall clock)
            "peak_rss_after_load_mb": model_line["rss"],
            "trainable_parameters": int(trainable.group(1).replace(",", "")) if trainable else None}


def trl_config(s: dict, work: Path, precompute: bool):
    """Every DPOConfig option that sets the objective or the work, explicitly (TRL 1.16's defaults
    differ: gradient_checkpointing=True, bf16 where supported, lr 1e-6, shuffled pairs). TRL 1.16 has
    no rpo_alpha / reference_free / use_logits_to_keep options (checked by introspection): its loss is
    the plain reference-based one, and its DPO forward already asks for the fused LM head."""
    from trl import DPOConfig
    return DPOConfig(
        output_dir=str(work / "trl_out"), max_steps=s["steps"], per_device_train_batch_size=PAIRS_PER_STEP,
        gradient_accumulation_steps=1, learning_rate=s["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        optim="adamw_torch_fused",  # TRL's default; the same AdamW as retrograd's, fused
        # the objective: sigmoid DPO, beta, no smoothing / weighting / length-desensitising, fixed reference
        loss_type=["sigmoid"], loss_weights=None, beta=BETA, label_smoothing=0.0, use_weighting=False,
        ld_alpha=None, f_divergence_type="reverse_kl", sync_ref_model=False, disable_dropout=True,
        precompute_ref_log_probs=precompute, precompute_ref_batch_size=PAIRS_PER_STEP,
        # data: nothing truncated at this length, no padding-free packing, pairs in file order
        max_length=MAX_LEN, truncation_mode="keep_start", padding_free=False, pad_to_multiple_of=None,
        train_sampling_strategy="sequential", dataloader_drop_last=False,
        use_cpu=True, bf16=False, fp16=False, gradient_checkpointing=False, activation_offloading=False,
        use_liger_kernel=False, torch_compile=False,
        seed=SEED, data_seed=SEED, dataloader_num_workers=0, logging_steps=1, report_to="none",
        save_strategy="no", eval_strategy="no", disable_tqdm=True)


def worker_trl(s: dict, work: Path, precompute: bool = False) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback, set_seed
    from trl import DPOTrainer
    torch.set_num_threads(THREADS)
    set_seed(SEED)
    rows = [json.loads(x) for x in Path(s["data"]).read_text().splitlines()]
    model, tok = load_trl_model(s["model"])
    after_load = self_peak_rss_mb()

    # time TRL's reference pass (it runs inside DPOTrainer.__init__) and count its batches, so a
    # datasets cache hit could not make the precompute side look free
    timing = {"precompute_s": 0.0, "ref_batches": 0}
    original_pass, original_batch = DPOTrainer._precompute_ref_logps, DPOTrainer.compute_ref_log_probs

    def timed_pass(self, *a, **k):
        t = time.perf_counter()
        out = original_pass(self, *a, **k)
        timing["precompute_s"] += time.perf_counter() - t
        return out

    def counted_batch(self, *a, **k):
        timing["ref_batches"] += 1
        return original_batch(self, *a, **k)
    DPOTrainer._precompute_ref_logps, DPOTrainer.compute_ref_log_probs = timed_pass, counted_batch

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.begin, self.end = [], []

        def on_step_begin(self, *a, **k):
            self.begin.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            self.end.append(time.perf_counter())

    timer = StepTimer()
    lora = LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, lora_dropout=0.0, target_modules=LORA_TARGETS,
                      bias="none", task_type="CAUSAL_LM")
    trainer = DPOTrainer(model=model, args=trl_config(s, work, precompute), train_dataset=Dataset.from_list(rows),
                         processing_class=tok, peft_config=lora, callbacks=[timer])
    if precompute and timing["ref_batches"] == 0:
        raise RuntimeError("precompute_ref_log_probs=True computed nothing (a cached result?): its time would be missing")
    t_train = time.perf_counter()
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x]
    return {"step_s": [e - b for b, e in zip(timer.begin, timer.end)], "loss": [x["loss"] for x in logs],
            "reward_accuracy": [x.get("rewards/accuracies") for x in logs],
            "reference_s": timing["precompute_s"], "reference_batches": timing["ref_batches"],
            "loop_s": timer.end[-1] - t_train, "before_step1_s": timer.begin[0] - t_train,
            "train_wall_s": time.perf_counter() - t_train, "peak_rss_after_load_mb": after_load,
            "trainable_parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)}


WORKERS = {"prepare": prepare, "retrograd": worker_retrograd, "trl": worker_trl,
           "trl_precompute": lambda s, work: worker_trl(s, work, precompute=True)}


def check_runs(runs: dict) -> dict:
    counts = {r.get("trainable_parameters") for rs in runs.values() for r in rs}
    if len(counts) > 1:
        raise common.CheckFailed(f"bench_dpo: the sides train different numbers of parameters: {sorted(counts, key=str)}")
    return common.check_losses("bench_dpo", {k: [r["loss"] for r in v] for k, v in runs.items() if v}, "trl",
                               LOSS_TOL, REPEAT_TOL)


def per_run_metrics(pairs: int) -> dict:
    steady = common.steady

    def e2e_s(r):
        return r["reference_s"] + sum(r["step_s"])
    return {
        "pairs_per_s": lambda r: PAIRS_PER_STEP * len(steady(r["step_s"])) / sum(steady(r["step_s"])),
        "pairs_per_s_end_to_end": lambda r: pairs / e2e_s(r),
        "pairs_per_s_wall": lambda r: pairs / (r["reference_s"] + r["loop_s"]),
        "step_s": lambda r: sum(steady(r["step_s"])) / len(steady(r["step_s"])),
        "end_to_end_s": e2e_s,
        "reference_s": lambda r: r["reference_s"],
        "outside_steps_s": lambda r: r["loop_s"] - sum(r["step_s"]),  # loop start to step 1, between steps
        "peak_rss_mb": lambda r: max(r["process_peak_rss_mb"], r["worker_peak_rss_mb"]),
        "peak_rss_after_load_mb": lambda r: r["peak_rss_after_load_mb"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=1,
                   help="passes over the pairs within --steps (the data is steps x 2 / epochs pairs); with 2+ one "
                        "reference scoring serves every epoch")
    add_common_args(p, 10, WORKERS)
    args = p.parse_args()
    if args.worker:
        worker_entry(args, WORKERS)
        return
    steps = args.steps or (SMOKE["steps"] if args.smoke else 10)
    repeats = args.repeats or (SMOKE["repeats"] if args.smoke else 3)
    pairs = steps * PAIRS_PER_STEP  # pairs trained, over all epochs
    if steps < 2 or pairs % args.epochs:
        p.error("--steps must be at least 2, and steps x 2 divisible by --epochs")
    common.warn_if_busy()
    load = {"start": common.load_average()}
    peak = common.matmul_peak()
    with tempfile.TemporaryDirectory(prefix="bench_dpo-") as tmp_name:
        tmp = Path(tmp_name)
        s = {"smoke": args.smoke, "steps": steps, "epochs": args.epochs, "lr": SMOKE["lr"] if args.smoke else LR,
             "data": str(tmp / "pairs.jsonl")}
        write_data(Path(s["data"]), pairs // args.epochs)
        settings = tmp / "settings.json"
        write_json(settings, s)
        prep = run_worker(__file__, "prepare", tmp / "prepare", settings, "prepare")
        s["model"] = prep["model"]
        write_json(settings, s)
        checks = {}

        def one(kind, i):
            return run_worker(__file__, kind, tmp / f"{kind}-{i + 1}", settings, f"{kind} run {i + 1}")
        runs, order = common.run_interleaved(list(SIDES), repeats, one, lambda rs: checks.update(check_runs(rs)))
    summary = {k: common.summarize(v, per_run_metrics(pairs)) for k, v in runs.items()}
    first = runs["trl"][0]["loss"]
    result = {
        "machine": common.machine(peak), "load_average": {**load, "before_runs": order},
        "settings": {"steps": steps, "epochs": args.epochs, "repeats": repeats, "pairs_per_step": PAIRS_PER_STEP,
                     "distinct_pairs": pairs // args.epochs, "max_length": MAX_LEN, "lr": s["lr"], "beta": BETA,
                     "loss": "dpo sigmoid", "model_path": s["model"], "shape": prep["shape"],
                     "model": "tiny random Llama (smoke)" if args.smoke else f"builtin {BUILTIN} (GGUF Q4_1 -> fp32)",
                     "lora": dict(r=LORA_R, alpha=LORA_ALPHA, dropout=0.0, targets=LORA_TARGETS),
                     "threads": THREADS, "seed": SEED, "steady": "steps 2+",
                     "end_to_end": "reference scoring + every step", "wall": "reference scoring + loop start to last step"},
        "sides": {"retrograd": "retrograd", "trl": f"TRL {versions().get('trl')}",
                  "trl_precompute": f"TRL {versions().get('trl')} precompute_ref_log_probs=True"},
        "summary": summary,
        "ratios": {f"retrograd/{b}": common.ratios(summary, "retrograd", b) for b in ("trl", "trl_precompute")},
        "checks": {"loss": checks}, "loss": {"first": first[0], "last": first[-1]}, "prepare": prep, "runs": runs,
    }
    path = common.write_result("dpo", result, args.out, args.smoke)
    import report
    print("\n" + report.render(json.loads(path.read_text())))
    print(f"\nlargest loss differences vs TRL: {checks['max_abs_diff_vs_reference']}; across repeats: "
          f"{checks['max_abs_diff_across_repeats']}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
