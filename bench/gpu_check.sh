#!/usr/bin/env bash
# GPU check for a lent H200 (no network there): install, then the Qwen3-VL-8B architecture with random
# weights, an FSDP2 bf16 training step on multi-turn maze conversations and hf-engine generation.
# Prints step time, trained tokens/s, MFU and generated tokens/s; under 8 minutes.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, transformers" 2>/dev/null || pip install -q -r requirements.txt
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 450 torchrun --standalone --nproc-per-node=1 bench/gpu_check.py --seqs 8 --steps 3 --turns 8 \
    --gen-mazes 8 --gen-group 4 --gen-turns 4
