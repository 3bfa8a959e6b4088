"""Drive the UNMODIFIED tinker-cookbook training loops against a Tinker-compatible server.

    python tests/slow/cookbook_driver.py sft --base-url URL --model NAME --tokenizer DIR --log-path DIR
    python tests/slow/cookbook_driver.py rl  --base-url URL --model NAME --tokenizer DIR --log-path DIR

sft: ``tinker_cookbook.supervised.train.main`` (the loop ``recipes/sl_basic.py`` wraps) on ~40 short
     chat conversations written to ``LOG/conversations.jsonl``; renderer ``role_colon``, LoRA rank 8,
     batch 4, max_length 128, save_every 2, eval_every 2 (held-out NLL via a sampling client).
rl:  ``tinker_cookbook.rl.train.main`` (the loop ``recipes/rl_basic.py`` wraps) on the bundled
     arithmetic env: 2 batches x 2 groups x 4 samples, max_tokens 8, loss importance_sampling.

Re-running on the same log dir resumes from ``LOG/checkpoints.jsonl`` (behavior_if_exists="resume"):
a finished run becomes a no-op resume, and ``--num-epochs 2`` after a 1-epoch run trains epoch 2.
``--check`` builds the configs and datasets, then exits without contacting the server.

Offline: the tokenizer comes from DIR via the cookbook's tokenizer registry (no HF hub), the
pricing download (tinker-docs models.json) is skipped, wandb is not configured, telemetry is off.
"""

import argparse
import asyncio
import functools
import json
import os
import sys
from pathlib import Path

# Set before tinker / transformers / datasets are imported.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ["TINKER_TELEMETRY"] = "0"
os.environ.pop("WANDB_API_KEY", None)

TOPICS = ["red", "blue", "green", "cats", "dogs", "rain", "snow", "tea", "bread", "maps"]


def write_conversations(path: Path) -> None:
    """Write 40 short, deterministic chat conversations (identical on every run, so resume is exact)."""
    rows = []
    for i in range(40):
        a, b, t = i % 7 + 1, i % 5 + 2, TOPICS[i % len(TOPICS)]
        if i % 2:
            msgs = [{"role": "user", "content": f"What is {a} + {b}?"},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]
        else:
            msgs = [{"role": "system", "content": "Answer in one short sentence."},
                    {"role": "user", "content": f"Say something about {t}."},
                    {"role": "assistant", "content": f"I like {t}, number {i}."}]
        rows.append(json.dumps({"messages": msgs}))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(rows) + "\n")


def register_local_tokenizer(model: str, tokenizer_dir: str) -> None:
    from tinker_cookbook.tokenizer_utils import register_tokenizer
    from transformers import AutoTokenizer

    load = functools.cache(lambda: AutoTokenizer.from_pretrained(tokenizer_dir))
    register_tokenizer(model, load)


def disable_pricing_fetch() -> None:
    # CostTracker calls fetch_model_pricing() -> urllib GET tinker-docs.../models.json (5 s timeout).
    # Marking it as already fetched (with no entries) makes it return None: token counts only.
    from tinker_cookbook.utils import cost_estimation

    cost_estimation._pricing_fetched = True
    cost_estimation._pricing_entries = None


def sft_config(args):
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.supervised import train
    from tinker_cookbook.supervised.data import FromConversationFileBuilder
    from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

    data = Path(args.log_path) / "conversations.jsonl"
    write_conversations(data)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=args.model, renderer_name="role_colon", max_length=128,
        batch_size=4, train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES)
    builder = FromConversationFileBuilder(common_config=common, file_path=str(data), test_size=8)
    config = train.Config(
        log_path=args.log_path, model_name=args.model, recipe_name="retrograd_cookbook_sft",
        renderer_name="role_colon", dataset_builder=builder, learning_rate=1e-4, lora_rank=8,
        num_epochs=args.num_epochs, max_steps=args.steps, save_every=2, eval_every=2,
        rolling_save_every=args.rolling_save_every, base_url=args.base_url)
    return config, train.main


def rl_config(args):
    from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
    from tinker_cookbook.rl import train

    builder = ArithmeticDatasetBuilder(
        batch_size=2, group_size=4, n_batches=2, model_name_for_tokenizer=args.model,
        renderer_name="role_colon")
    config = train.Config(
        log_path=args.log_path, model_name=args.model, recipe_name="retrograd_cookbook_rl",
        renderer_name="role_colon", dataset_builder=builder, learning_rate=1e-4, lora_rank=8,
        max_tokens=8, loss_fn="importance_sampling", num_epochs=args.num_epochs,
        max_steps=args.steps, save_every=1, eval_every=0,
        rolling_save_every=args.rolling_save_every, base_url=args.base_url)
    return config, train.main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["sft", "rl"])
    p.add_argument("--base-url", required=True)
    p.add_argument("--model", required=True, help='server model name, e.g. "retrograd/tiny"')
    p.add_argument("--tokenizer", required=True, help="local HF tokenizer folder")
    p.add_argument("--log-path", required=True)
    p.add_argument("--api-key", default="tml-test")
    p.add_argument("--steps", type=int, default=None, help="max_steps (default: whole epochs)")
    p.add_argument("--num-epochs", type=int, default=1)
    p.add_argument("--rolling-save-every", type=int, default=0,
                   help="also save state-only rolling checkpoints (exercises checkpoint DELETE)")
    p.add_argument("--check", action="store_true", help="build configs/datasets, don't train")
    args = p.parse_args()
    args.log_path = str(Path(args.log_path).expanduser().resolve())
    os.environ["TINKER_BASE_URL"] = args.base_url
    os.environ["TINKER_API_KEY"] = args.api_key

    from tinker_cookbook import cli_utils

    register_local_tokenizer(args.model, args.tokenizer)
    disable_pricing_fetch()
    cli_utils.check_log_dir(args.log_path, behavior_if_exists="resume")
    config, train_main = (sft_config if args.mode == "sft" else rl_config)(args)

    if args.check:
        built = config.dataset_builder()
        train_ds, test_ds = asyncio.run(built) if asyncio.iscoroutine(built) else built
        print(f"{args.mode}: {len(train_ds)} train batches, test={test_ds is not None}; "
              f"first batch: {len(train_ds.get_batch(0))} items")
        return
    asyncio.run(train_main(config))


if __name__ == "__main__":
    sys.exit(main())
