"""Supervised fine-tuning through the tinker SDK against `retrograd serve`, with explicit
checkpoints, resume and verified downloads.

    retrograd serve &                                   # http://127.0.0.1:8000, built-in SmolLM2
    export TINKER_BASE_URL=http://127.0.0.1:8000 TINKER_API_KEY=$(cat ~/.cache/retrograd/serve/api-key)
    python examples/service/train_sft.py --max-steps 4 --batch-size 4 --save-every 2 --output-dir out/sft
    python examples/service/train_sft.py --resume-from "$(jq -r .path out/sft/latest-checkpoint.json)" \
        --start-step 4 --max-steps 8 --batch-size 4 --save-every 2 --skip-sample --verify-download \
        --output-dir out/sft-resumed

After every save it writes OUTPUT_DIR/latest-checkpoint.json (path, step, model, dataset): a locator,
not the weights. Each checkpoint records, in its user_metadata on the server, the dataset it was
trained on and the SHA-256 of its datums. --resume-from restores weights and optimizer state, refuses
a dataset other than the checkpoint's (by content, whatever its name), and skips start_step x
batch_size datums of the same dataset order. --verify-download finishes the session, downloads the
last checkpoint's files through the server's signed URLs into OUTPUT_DIR/verified-checkpoint/,
checks sizes and SHA-256 against the server's manifest and writes durable-verification.json.
--sample exports sampler weights, samples from them and writes sample.json (refused, with the
server's reason, under an actor-only policy).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import urllib.request
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-model", default="smollm2-135m-instruct", help="a model the server serves")
    p.add_argument("--dataset", default="builtin:chat-sft", help='JSONL of {"messages": [...]} rows, or builtin:NAME')
    p.add_argument("--resume-from", metavar="PATH", help="a tinker://.../weights/NAME checkpoint (with optimizer state)")
    p.add_argument("--start-step", type=int, default=0, help="steps already done by the checkpoint's run")
    p.add_argument("--max-steps", type=int, default=4, help="total target step count (must exceed --start-step)")
    p.add_argument("--batch-size", type=int, default=4, help="datums per step")
    p.add_argument("--save-every", type=int, default=2, help="save a resumable state every K steps (and at the end)")
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--max-length", type=int, default=256, help="tokens per datum (longer rows are truncated)")
    p.add_argument("--seed", type=int, default=0, help="LoRA initialisation seed")
    p.add_argument("--skip-sample", action="store_true", help="no sampling preview at the end")
    p.add_argument("--sample", action="store_true", help="export sampler weights, sample, write sample.json")
    p.add_argument("--verify-download", action="store_true",
                   help="download the last checkpoint into verified-checkpoint/ and verify it")
    p.add_argument("--output-dir", type=Path, required=True)
    args = p.parse_args(argv)
    if args.max_steps <= args.start_step:
        p.error(f"--max-steps ({args.max_steps}) is the total target step count; it must exceed --start-step "
                f"({args.start_step})")
    if args.start_step and not args.resume_from:
        p.error("--start-step needs --resume-from (the checkpoint of those steps)")
    return args


def load_datums(tokenizer, dataset: str, max_length: int):
    """Rows rendered with the model's chat template; loss on the assistant turns only (weights 1),
    model_input = tokens[:-1], target_tokens = tokens[1:]."""
    from tinker import types

    from retrograd.data.sft import IGNORE, Renderer, load_examples, resolve_data_path
    examples = load_examples(str(resolve_data_path(dataset)), "auto", Renderer(tokenizer, max_length, True))
    datums = []
    for e in examples:
        weights = [0.0 if lab == IGNORE else 1.0 for lab in e.labels[1:]]
        datums.append(types.Datum(model_input=types.ModelInput.from_ints(e.input_ids[:-1]),
                                  loss_fn_inputs={"target_tokens": e.input_ids[1:], "weights": weights}))
    return datums


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def http_json(url: str):
    req = urllib.request.Request(url, headers={"X-API-Key": os.environ["TINKER_API_KEY"]})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def verify_download(base_url: str, locator: dict, out: Path) -> dict:
    """Download every durable file of the checkpoint through its signed URLs and check it against
    the server's manifest (sizes and SHA-256)."""
    _, _, rest = locator["path"].partition("tinker://")
    run_id, kind, name = rest.split("/")
    manifest = http_json(f"{base_url}/api/v1/training_runs/{run_id}/checkpoints/{kind}/{name}/manifest")
    target = out / "verified-checkpoint"
    target.mkdir(parents=True, exist_ok=True)
    files, ok = {}, True
    for fname, expected in sorted(manifest["files"].items()):
        with urllib.request.urlopen(manifest["urls"][fname], timeout=300) as r:
            data = r.read()
        (target / fname).write_bytes(data)
        digest = hashlib.sha256(data).hexdigest()
        good = len(data) == expected["bytes"] and digest == expected["sha256"]
        ok &= good
        files[fname] = {"bytes": len(data), "sha256": digest, "expected_bytes": expected["bytes"],
                        "expected_sha256": expected["sha256"], "verified": good}
    report = {"path": locator["path"], "step": locator["step"], "model": locator["model"],
              "dataset": locator["dataset"], "directory": str(target), "files": files, "verified": ok,
              "verified_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    write_json(out / "durable-verification.json", report)
    return report


def datums_sha256(datums) -> str:
    """What the run trains on, by content: the SHA-256 of every datum's tokens and weights, in order."""
    h = hashlib.sha256()
    for d in datums:
        h.update(json.dumps([d.model_input.to_ints(), d.loss_fn_inputs["weights"].tolist()]).encode())
    return h.hexdigest()


def checkpoint_metadata(path: str) -> dict:
    """The user_metadata a checkpoint was saved with (the server's registry keeps it)."""
    import tinker
    run_id = path.split("/")[2]
    listed = tinker.RestClient().list_checkpoints(run_id).result().checkpoints
    return next((dict(c.user_metadata or {}) for c in listed if c.tinker_path == path), {})


def main(argv=None) -> int:
    args = parse_args(argv)
    import tinker
    from tinker import types

    base_url = os.environ.get("TINKER_BASE_URL", "http://127.0.0.1:8000").rstrip("/")
    if not os.environ.get("TINKER_API_KEY"):
        print("error: set TINKER_API_KEY (retrograd serve wrote one for you to $RETROGRAD_HOME/serve/api-key)",
              file=sys.stderr)
        return 2
    args.output_dir.mkdir(parents=True, exist_ok=True)
    sc = tinker.ServiceClient(base_url=base_url)
    if args.resume_from:
        tc = sc.create_training_client_from_state_with_optimizer(args.resume_from).result()
        if tc.get_info().model_data.model_name != args.base_model:
            print(f"error: {args.resume_from} was trained on {tc.get_info().model_data.model_name}, "
                  f"not --base-model {args.base_model}", file=sys.stderr)
            return 2
    else:
        tc = sc.create_lora_training_client(base_model=args.base_model, rank=args.lora_rank, seed=args.seed).result()
    datums = load_datums(tc.get_tokenizer(), args.dataset, args.max_length)
    data_sha256 = datums_sha256(datums)
    print(f"model {tc.model_id} ({args.base_model}), {len(datums)} datums from {args.dataset}")
    if args.resume_from:  # the checkpoint says what it was trained on: refuse other data
        trained_on = checkpoint_metadata(args.resume_from)
        if trained_on.get("data_sha256") not in (None, data_sha256):
            print(f"error: {args.resume_from} was trained on {trained_on.get('dataset')!r} (datums SHA-256 "
                  f"{trained_on['data_sha256'][:12]}), but --dataset {args.dataset!r} gives {data_sha256[:12]}: "
                  "resume with the checkpoint's dataset, or start a new run", file=sys.stderr)
            return 2

    locator, metrics = None, (args.output_dir / "metrics.jsonl").open("a")
    for step in range(args.start_step, args.max_steps):
        start = step * args.batch_size  # resume skips start_step x batch_size datums, the order is fixed
        batch = [datums[(start + i) % len(datums)] for i in range(args.batch_size)]
        n_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        fb = tc.forward_backward(batch, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.learning_rate))
        loss = fb.result().metrics["loss:sum"] / max(1.0, n_tokens)
        opt.result()
        metrics.write(json.dumps({"step": step + 1, "train_mean_nll": loss, "tokens": n_tokens}) + "\n")
        metrics.flush()
        print(f"step {step + 1}/{args.max_steps}  nll {loss:.4f}")
        if (step + 1) % args.save_every == 0 or step + 1 == args.max_steps:
            path = tc.save_state(f"step-{step + 1:06d}", user_metadata={
                "dataset": args.dataset, "data_sha256": data_sha256, "step": str(step + 1)}).result().path
            locator = {"path": path, "step": step + 1, "model": args.base_model, "dataset": args.dataset}
            write_json(args.output_dir / "latest-checkpoint.json", locator)
            print(f"saved {path}")

    if args.sample or not args.skip_sample:
        try:
            sampler_path = tc.save_weights_for_sampler(f"sampler-{args.max_steps:06d}").result().path
            sampler = sc.create_sampling_client(model_path=sampler_path).result()
            tok = tc.get_tokenizer()
            prompt_ids = tok.apply_chat_template([{"role": "user", "content": "Reverse this list: 1, 2, 3"}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)
            out = sampler.sample(types.ModelInput.from_ints(list(prompt_ids)), 1,
                                 types.SamplingParams(max_tokens=48, temperature=0.0)).result()
            text = tok.decode(out.sequences[0].tokens, skip_special_tokens=True)
            print(f"sample: {text!r}")
            if args.sample:
                write_json(args.output_dir / "sample.json", {"model_path": sampler_path, "prompt": "Reverse this "
                           "list: 1, 2, 3", "completion": text, "tokens": list(out.sequences[0].tokens),
                           "stop_reason": out.sequences[0].stop_reason})
        except tinker.PermissionDeniedError as e:
            if args.sample:
                print(f"error: the server refused sampling: {e}", file=sys.stderr)
                return 3
            print(f"(no sampling preview: {e})")

    if args.verify_download:
        sc.close("success").result()  # finish the session before the durable copy is taken
        report = verify_download(base_url, locator, args.output_dir)
        print(f"verified {len(report['files'])} files of {locator['path']} -> {report['directory']}: "
              f"{'OK' if report['verified'] else 'MISMATCH'}")
        if not report["verified"]:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
