#!/usr/bin/env bash
# One prepared check of retrograd's CUDA path, for a machine with an NVIDIA GPU:
#   bash scripts/gpu_check.sh            (OUT=/some/folder to keep the runs; default a temp folder)
# It installs retrograd if it is not importable, then runs on cuda:
#   1. the quickstart (LoRA SFT), 30 steps;
#   2. a GRPO run (examples/grpo.toml), 5 updates;
#   3. the quickstart again under torchrun with 1 process per GPU (up to 2);
# and prints tokens/s, model FLOPs utilisation against the bf16 matmul peak it measures there, and
# peak GPU memory for each. The model is the built-in SmolLM2-135M-Instruct when it is cached or can
# be fetched, else a random model of SmolLM2-135M's shape (the same FLOPs; machines without network).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$(mktemp -d)}
export PYTHONPATH="$PWD/src:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}"
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'torch sees no CUDA device')"
python -c "import retrograd" 2>/dev/null || pip install -q -e .
MODEL=$(python scripts/gpu_report.py model "$OUT/model")
echo "model: $MODEL; runs in $OUT"
NGPU=$(python -c "import torch; print(min(2, torch.cuda.device_count()))")
COMMON=(--device cuda --model "$MODEL")

python -m retrograd train examples/quickstart.toml "${COMMON[@]}" --set training.max_steps=30 \
  --set run.directory="\"$OUT/sft\"" --set output.path="\"$OUT/sft-adapter\""
python -m retrograd train examples/grpo.toml "${COMMON[@]}" --set grpo.updates=5 \
  --set run.directory="\"$OUT/grpo\"" --set output.path="\"$OUT/grpo-adapter\"" \
  --set checkpoint.directory="\"$OUT/grpo-ckpt\""
torchrun --standalone --nproc-per-node "$NGPU" -m retrograd train examples/quickstart.toml "${COMMON[@]}" \
  --set training.max_steps=30 --set run.directory="\"$OUT/torchrun\"" --set output.path="\"$OUT/torchrun-adapter\""

python scripts/gpu_report.py report "$MODEL" "$OUT/sft" "$OUT/grpo" "$OUT/torchrun"
