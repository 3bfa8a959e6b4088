"""`retrograd` command line: argument parsing only, then a call into the engine.

Errors caused by the user's input (RetrogradError) print one clear message and exit 2, never a
traceback. A run stopped by SIGINT/SIGTERM saves and exits 128+signal (130 / 143). Under torchrun, a
rank that fails prints its error (prefixed by its rank) and exits at once without waiting for the
others, so torchrun stops every rank instead of letting them wait on a collective.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from retrograd import __version__
from retrograd.errors import RetrogradError

TRAIN_HELP = """\
Run the training job described by a run.toml.

examples:
  retrograd train examples/quickstart.toml
  retrograd train run.toml --set training.lr=1e-5 --set training.max_steps=50
  retrograd train run.toml --resume                      # latest step-*.state, else best.state
  retrograd train run.toml --resume ckpt/step-000000000100.state
  retrograd train run.toml --nproc 2                     # 2 processes on this machine (torchrun)
  torchrun --nproc-per-node 2 -m retrograd train run.toml
"""


def _trained_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="path to the run.toml")
    p.add_argument("--adapter", metavar="PATH", help="a PEFT adapter folder or .gguf adapter (default: [output].path)")
    p.add_argument("--checkpoint", metavar="DIR", help="a step-*.state or best.state")
    p.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", dest="overrides",
                   help="override a config key, as in `retrograd train` (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="retrograd", description="Post-training for language models, driven by one TOML file.")
    p.add_argument("--version", action="version", version=f"retrograd {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    t = sub.add_parser("train", help="run a training job from a TOML file", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    t.add_argument("config", help="path to the run.toml")
    t.add_argument("--resume", nargs="?", const="latest", default=None, metavar="PATH",
                   help="continue exactly where a run stopped: without PATH the latest step-*.state in "
                        "[checkpoint].directory (else best.state), or the given .state folder")
    t.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", dest="overrides",
                   help="override a config key, e.g. --set training.lr=1e-5 (repeatable; the value is "
                        "read as TOML, a bare word as a string)")
    t.add_argument("--model", metavar="PATH", help="override [model].path (HF folder, .gguf, or built-in alias)")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), help="override [model].device")
    t.add_argument("--threads", type=int, metavar="N", help="override [training].threads (torch CPU threads)")
    t.add_argument("--nproc", type=int, metavar="N", default=None,
                   help="train with N processes on this machine: runs `torchrun --standalone --nproc-per-node N -m "
                        "retrograd train ...` (for several machines call torchrun yourself; see README, Scaling)")

    ev = sub.add_parser("eval", help="loss and perplexity of the base and the trained model on evaluation data")
    _trained_model_args(ev)
    ev.add_argument("--data", metavar="PATH", help="evaluation data (default: [evaluation].data)")
    ev.add_argument("--json", action="store_true", help="print JSON")

    ch = sub.add_parser("chat", help="talk to the base and the trained model")
    _trained_model_args(ch)
    ch.add_argument("--base-only", action="store_true", help="chat with the base model alone")
    ch.add_argument("--compare", action="store_true", help="answer each message with the base and the trained model")
    ch.add_argument("--system", metavar="TEXT", help="a system prompt")
    ch.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="reply length limit (256)")
    ch.add_argument("--temperature", type=float, default=0.7, metavar="T", help="0 for greedy (0.7)")
    ch.add_argument("--top-p", type=float, default=0.95, metavar="P", help="nucleus sampling (0.95)")
    ch.add_argument("--seed", type=int, default=0, help="sampling seed (0)")

    e = sub.add_parser("export", help="write a checkpoint as a llama.cpp adapter, PEFT folder or HF model",
                       description="Rebuild the model a .state checkpoint was trained on and write it out.")
    e.add_argument("checkpoint", help="a step-*.state or best.state folder")
    e.add_argument("--format", required=True, choices=("gguf", "peft", "hf", "gguf-merged"),
                   help="gguf: llama.cpp LoRA adapter; peft: PEFT adapter folder; hf: HF model folder "
                        "(LoRA merged into the weights, or the full fine-tune); gguf-merged: a llama.cpp model "
                        "with the LoRA merged in, or the full fine-tune")
    e.add_argument("--out", required=True, metavar="PATH", help="the file (gguf) or folder to write")
    e.add_argument("--dtype", default="f32", choices=("f32", "f16", "bf16", "q8_0"),
                   help="tensor dtype: adapters f32/f16 (peft also bf16); gguf-merged f32/f16/q8_0")
    e.add_argument("--force", action="store_true", help="replace PATH if it exists")

    i = sub.add_parser("inspect", help="describe a model: architecture, sizes, dtype, suggested LoRA targets")
    i.add_argument("--model", required=True, metavar="PATH", help="HF folder, .gguf file, or built-in alias")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")

    from retrograd.service.cli import add_parsers as add_service_parsers
    add_service_parsers(sub)

    pl = sub.add_parser("plugins", help="list the policy losses, advantage modes, token transforms, recipes and reward "
                                        "types a run.toml can name (and the plugins a given run.toml uses)")
    pl.add_argument("config", nargs="?", help="a run.toml: also resolve the user functions it names")
    pl.add_argument("--json", action="store_true", help="print JSON")

    tc = sub.add_parser("trace", help="run a run.toml's advantage pipeline on synthetic groups and show each token's "
                                      "uncertainty, planning mask, SEPA lambda and final advantage (no model loaded)")
    tc.add_argument("config", help="path to the run.toml (an RL run)")
    tc.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", dest="overrides",
                    help="override a config key (as in train)")
    tc.add_argument("--step", type=int, metavar="N", help="the update to trace (default: mid-way through the SEPA "
                                                          "ramp, or 0)")
    tc.add_argument("--groups", type=int, default=2, metavar="P", help="synthetic groups (2)")
    tc.add_argument("--json", action="store_true", help="print JSON")

    dt = sub.add_parser("distill-teacher", help="write the teacher's top-k log-probs for offline distillation",
                        description="Run [distill].teacher_path once over distill.data (and [evaluation].data) and "
                                    "write its k most likely tokens per trained position; training with mode = "
                                    "\"topk_offline\" then needs no teacher in memory.")
    dt.add_argument("config", help="path to the run.toml (algorithm = \"distill\", mode = \"topk_offline\")")
    dt.add_argument("--k", type=int, default=16, metavar="N", help="tokens kept per position (16)")
    dt.add_argument("--out", metavar="F.topk", help="output file (default: distill.sidecar)")
    dt.add_argument("--data", metavar="PATH", help="override distill.data")
    dt.add_argument("--ctx", type=int, metavar="N", help="override training.ctx (training must use the same)")
    dt.add_argument("--model", metavar="PATH", help="override distill.teacher_path")
    dt.add_argument("--device", choices=("auto", "cpu", "cuda"), help="override [model].device")

    it = sub.add_parser("init", help="write a starter run.toml (or service client) that runs as written")
    it.add_argument("--template", default="sft", choices=("sft", "dpo", "grpo", "ppo", "distill", "service"),
                    help="what to start from (sft)")
    it.add_argument("--out", metavar="FILE", help="where to write it (default run.toml, <template>.toml, train_sft.py)")
    it.add_argument("--force", action="store_true", help="overwrite an existing file")

    cp = sub.add_parser("campaign", help="conditions x seeds from one file, each run in its own folder",
                        description="Run a campaign file: a run config plus [campaign] (seeds, [[campaign.conditions]] "
                                    "label + set) and optionally [squeeze]; see retrograd/campaign.py")
    cp.add_argument("config", help="path to the campaign .toml")
    cp.add_argument("--resume", action="store_true", help="finish an interrupted campaign: unfinished runs continue "
                                                          "from their checkpoints, the others start")

    ex = sub.add_parser("explain", help="a dry run: resolved config and where each value came from, data, steps, "
                                         "time and memory estimates, warnings (no weights loaded)")
    ex.add_argument("config", help="path to the run.toml")
    ex.add_argument("--set", action="append", default=[], metavar="TABLE.KEY=VALUE", dest="overrides",
                    help="override a config key, as in `retrograd train`")
    ex.add_argument("--json", action="store_true", help="print JSON")

    st = sub.add_parser("status", help="runs (and campaigns) under a folder: state, step, ETA, last metrics")
    st.add_argument("folder", nargs="?", default=".", help="where to look (default: here)")
    st.add_argument("--watch", action="store_true", help="refresh every 5 s until interrupted")
    st.add_argument("--json", action="store_true", help="print JSON")
    df = sub.add_parser("diff", help="two runs side by side: config differences, last metrics, curves",
                        description="retrograd diff RUN_A RUN_B, or retrograd diff CAMPAIGN COND_A COND_B")
    df.add_argument("first", help="a run folder (or a campaign folder)")
    df.add_argument("second", help="a run folder (or the first condition's label)")
    df.add_argument("third", nargs="?", help="with a campaign: the second condition's label")
    df.add_argument("--json", action="store_true", help="print JSON")

    pl = sub.add_parser("plot", help="line plots of logged metrics (PNG + HTML report); needs retrograd[plot]")
    pl.add_argument("targets", nargs="+", metavar="RUN_OR_CAMPAIGN", help="run folders, folders of runs, or campaigns")
    pl.add_argument("--metric", action="append", dest="metrics", metavar="M",
                    help="a logged metric, e.g. eval/mean_reward (repeatable; default: the headline ones)")
    pl.add_argument("--out", default="curves.png", metavar="FILE.png", help="the image (curves.png); the report "
                                                                           "goes beside it as .html")
    pl.add_argument("--json", action="store_true", help="print JSON")

    dr = sub.add_parser("doctor", help="check this machine: torch, CPU, devices, optional extras, model cache, disk")
    dr.add_argument("--json", action="store_true", help="print JSON")

    sq = sub.add_parser("squeeze", help="LoRA-Squeeze: the variance each rank of an adapter carries, and a smaller "
                                         "adapter", description="Retained variance per layer and on average at each "
                                         "target rank (from the LoRA factors alone, never the full update), the "
                                         "recommended rank, and with --out the compressed adapter (alpha / r kept).")
    sq.add_argument("adapter", help="a PEFT adapter folder, a .gguf LoRA adapter or a .state checkpoint")
    sq.add_argument("--target-ranks", metavar="K,K,...", help="ranks to report (default 1, 2, 4, ... and the rank)")
    sq.add_argument("--min-retention", type=float, default=0.95, metavar="F",
                    help="the recommended rank keeps at least this mean share of the variance (0.95)")
    sq.add_argument("--rank", type=int, metavar="K", help="compress to this rank (default: the recommended one)")
    sq.add_argument("--out", metavar="PATH", help="write the compressed adapter here (same format; a .state's as PEFT)")
    sq.add_argument("--json", action="store_true", help="print JSON")

    jd = sub.add_parser("judge", help="check a run's LLM judge before training with it")
    jsub = jd.add_subparsers(dest="judge_command", metavar="SUBCOMMAND", required=True)
    je = jsub.add_parser("eval", help="agreement with labelled fixtures (Kendall tau, Spearman rho) and "
                                      "self-consistency of the run's [grpo.judge] / [ppo.judge]")
    je.add_argument("config", help="path to the run.toml")
    je.add_argument("--fixtures", required=True, metavar="F.jsonl",
                    help='rows {"prompt": ..., "completions": [...], "labels": [...]} (optional "rubric")')
    je.add_argument("--json", action="store_true", help="print JSON")

    s = sub.add_parser("config-schema", help="print the JSON Schema of run.toml (for editor completion)")
    s.add_argument("--out", metavar="FILE", help="write to FILE instead of stdout")
    return p


def _launch_torchrun(nproc: int, argv: list[str]) -> int:
    """Replace this process by torchrun running `retrograd train` (argv without --nproc) on nproc ranks."""
    rest, skip = [], False
    for i, a in enumerate(argv):
        if skip:
            skip = False
            continue
        if a == "--nproc":
            skip = True
            continue
        if not a.startswith("--nproc="):
            rest.append(a)
    env = dict(os.environ)
    # one process per core share: several torch thread pools on the same cores slow every rank 20-100x
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "retrograd", *rest]
    sys.stdout.flush()
    os.execve(sys.executable, cmd, env)
    return 0  # not reached


def _train(args, argv: list[str]) -> int:
    if args.nproc is not None:
        if args.nproc < 1:
            print(f"error: --nproc {args.nproc}: give the number of processes, 1 or more", file=sys.stderr)
            return 2
        if "WORLD_SIZE" in os.environ:
            print("error: --nproc starts torchrun; this process already runs under torchrun (WORLD_SIZE is set): "
                  "drop --nproc", file=sys.stderr)
            return 2
    from retrograd.config import load_config
    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"model.path={json.dumps(args.model)}")
    if args.device:
        overrides.append(f"model.device={json.dumps(args.device)}")
    if args.threads:
        overrides.append(f"training.threads={args.threads}")
    cfg = load_config(args.config, overrides)  # a config error is told once, before any process starts
    if args.nproc is not None and args.nproc > 1:
        return _launch_torchrun(args.nproc, argv)
    if cfg.run.algorithm == "preference":
        from retrograd.train.preference import train_preference as train
    elif cfg.run.algorithm == "grpo":
        from retrograd.train.grpo import train_grpo as train
    elif cfg.run.algorithm == "ppo":
        from retrograd.train.ppo import train_ppo as train
    elif cfg.run.algorithm == "distill":
        from retrograd.train.distill import train_distill as train
    else:
        from retrograd.train.sft import train_sft as train
    result = train(cfg, resume=args.resume)
    from retrograd import dist
    dist.teardown()
    return result.exit_code


def _eval(args) -> int:
    from retrograd.cli.tools import run_eval
    from retrograd.config import load_config
    return run_eval(load_config(args.config, args.overrides), args.adapter, args.checkpoint, args.data, args.json)


def _chat(args) -> int:
    from retrograd.cli.tools import run_chat
    from retrograd.config import load_config
    return run_chat(load_config(args.config, args.overrides), args.adapter, args.checkpoint, args.base_only, args.compare,
                    args.system, args.max_new_tokens, args.temperature, args.top_p, args.seed)


def _export(args) -> int:
    from retrograd.export.from_checkpoint import export_checkpoint
    out = export_checkpoint(args.checkpoint, args.format, args.out, args.dtype, args.force,
                            log=lambda msg: print(msg, file=sys.stderr))
    print(f"wrote {out}")
    return 0


def _inspect(args) -> int:
    from retrograd.models.describe import describe, format_description
    from retrograd.models.load import load_model
    loaded = load_model(args.model, log=lambda msg: print(msg, file=sys.stderr))
    d = describe(loaded)
    print(json.dumps(d, indent=2) if args.json else format_description(d))
    return 0


def _plugins(args) -> int:
    from retrograd.plugins import catalog, format_catalog
    cfg = None
    if args.config:
        from retrograd.config import load_config
        cfg = load_config(args.config)
    c = catalog(cfg)
    print(json.dumps(c, indent=2, default=str) if args.json else format_catalog(c))
    return 0


def _distill_teacher(args) -> int:
    from retrograd.config import load_config
    from retrograd.train.distill_offline import write_teacher_topk
    overrides = [f"{key}={json.dumps(value)}" for key, value in (("distill.data", args.data), ("training.ctx", args.ctx),
                 ("distill.teacher_path", args.model), ("model.device", args.device)) if value is not None]
    cfg = load_config(args.config, overrides)
    if args.out is None and (cfg.distill is None or cfg.distill.sidecar is None):
        print("error: give --out F.topk or distill.sidecar in the run.toml", file=sys.stderr)
        return 2
    write_teacher_topk(cfg, args.k, args.out)
    return 0


def _trace(args) -> int:
    from retrograd.config import load_config
    from retrograd.errors import ConfigError
    from retrograd.train.trace import format_trace, trace
    cfg = load_config(args.config, args.overrides)
    if cfg.grpo is None:
        raise ConfigError(f"{args.config}: retrograd trace runs an RL run's advantage pipeline; this run is "
                          f"{cfg.run.algorithm!r}")
    if args.groups < 1:
        raise ConfigError("--groups must be at least 1")
    t = trace(cfg, args.step, args.groups)
    print(json.dumps(t, indent=2) if args.json else format_trace(t))
    return 0


def _config_schema(args) -> int:
    from retrograd.config.load import json_schema
    text = json.dumps(json_schema(), indent=2)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    else:
        print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    from retrograd import malloc
    if argv is None:  # the process's own entry point (the console script, python -m retrograd)
        malloc.restart_with_reusable_blocks()  # first of all, before torch is imported: see malloc.py
    malloc.keep_freed_memory()  # before torch and the model allocate: see malloc.py
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        if args.command == "train":
            return _train(args, argv)
        if args.command == "eval":
            return _eval(args)
        if args.command == "chat":
            return _chat(args)
        if args.command == "export":
            return _export(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "config-schema":
            return _config_schema(args)
        if args.command == "plugins":
            return _plugins(args)
        if args.command == "trace":
            return _trace(args)
        if args.command == "distill-teacher":
            return _distill_teacher(args)
        if args.command == "campaign":
            from retrograd.campaign import run_campaign
            return run_campaign(args.config, args.resume)
        if args.command == "explain":
            from retrograd.cli.explain import run_explain
            return run_explain(args.config, args.overrides, args.json)
        if args.command == "status":
            from retrograd.cli.status import run_status
            return run_status(args.folder, args.watch, args.json)
        if args.command == "diff":
            from retrograd.cli.status import run_diff
            return run_diff(args.first, args.second, args.third, args.json)
        if args.command == "init":
            from retrograd.cli.init import run_init
            return run_init(args.template, args.out, args.force)
        if args.command == "plot":
            from retrograd.cli.plot import run_plot
            return run_plot(args.targets, args.metrics, args.out, args.json)
        if args.command == "doctor":
            from retrograd.cli.doctor import run_doctor
            return run_doctor(args.json)
        if args.command == "squeeze":
            from retrograd.export.squeeze import run_squeeze
            ranks = None
            if args.target_ranks:
                try:
                    ranks = [int(x) for x in args.target_ranks.split(",") if x.strip()]
                except ValueError:
                    print(f"error: --target-ranks {args.target_ranks!r}: give integers separated by commas", file=sys.stderr)
                    return 2
            return run_squeeze(args.adapter, ranks, args.min_retention, args.out, args.rank, args.json)
        if args.command == "judge":
            from retrograd.config import load_config
            from retrograd.rl.judge_eval import run_judge_eval
            return run_judge_eval(load_config(args.config), args.fixtures, args.json)
        if args.command in ("serve", "checkpoint"):
            from retrograd.service.cli import main_for
            return main_for(args)
    except RetrogradError as e:
        print(f"{_rank_prefix()}error: {e}", file=sys.stderr)
        _exit_now_if_distributed(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        _exit_now_if_distributed(130)
        return 130
    except Exception:
        from retrograd import dist
        if not dist.current().distributed:
            raise
        print(f"[rank {dist.current().rank}] failed:", file=sys.stderr)
        traceback.print_exc()
        _exit_now_if_distributed(1)
        raise
    return 2


def _rank_prefix() -> str:
    """Ranks other than 0 name themselves (also before the process group exists, e.g. a config error)."""
    rank = os.environ.get("RANK", "0") if "WORLD_SIZE" in os.environ else "0"
    return f"[rank {rank}] " if rank != "0" else ""


def _exit_now_if_distributed(code: int) -> None:
    """A failing rank leaves at once: its peers may be blocked in a collective that will never complete,
    and an orderly interpreter exit with a live process group can wait on them. torchrun sees the exit
    code and stops the other ranks."""
    from retrograd import dist
    if dist.current().distributed:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
