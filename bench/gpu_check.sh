#!/usr/bin/env bash
# The GPU check, for a lent H200 (no network there; under 8 minutes). It runs on the machine's own stack (torch
# 2.11 + CUDA 13, transformers 5.17, no hydra/vllm/flash-attn) plus the few small wheels it lacks, which travel in
# .whl/ (made here by `bash bench/gpu_wheels.sh`; nothing is installed from a network):
#   1. python train.py cluster=1gpu on the tiny Qwen3-VL: torchrun, a process group of one on NCCL, FSDP2 with
#      fp32 masters and bf16 compute, 2 steps with a checkpoint at step 2 (its time printed), then a resume to
#      step 4 from it;
#   2. bench/gpu_check.py: a training step of the 8B architecture's layer shapes with as many decoder layers as
#      fit, its MFU, the attention implementation that ran (sdpa's backends; flash-attention 2 where installed),
#      the measured peak memory beside the plan's, a packed micro-batch against padded rows under that kernel,
#      and the time to write, hash and verify a checkpoint of that model (skipped, saying so, when the disk
#      cannot hold it three times over).
# Every figure is printed; any failure stops the script with a non-zero status.
#   bash bench/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if ! python3 -c "import hydra, omegaconf" 2>/dev/null; then
    ls .whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: hydra is missing and .whl/ holds no wheels (bash bench/gpu_wheels.sh)"; exit 2; }
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"

run=$(mktemp -d /tmp/gpu_check_run.XXXX)
common=(cluster=1gpu model.dtype=bfloat16 trainer.eval_every=2 trainer.eval_suites=[size7] trainer.eval_at_start=false
        trainer.save_every=2 algo.mazes_per_step=4 algo.group_size=4 "hydra.run.dir=$run")
echo "== 1. train.py cluster=1gpu (tiny Qwen3-VL, NCCL, FSDP2 bf16 mixed precision), checkpoint, resume"
timeout 150 python3 train.py "${common[@]}" trainer.steps=2 2>&1 | grep -v "it/s\]" | grep -E "launch plan|relaunching|step [0-9]+/|eval step|saved|ranks|precision|Error|error" || true
test -f "$run/checkpoints/step_2/dcp/.metadata" || { echo "gpu_check: FAILED: no sharded checkpoint at step 2"; exit 1; }
timeout 150 python3 train.py "${common[@]}" trainer.steps=4 2>&1 | grep -v "it/s\]" | tee "$run/resume.log" | grep -E "resumed from|step [0-9]+/|eval step|saved|Error|error" || true
grep -q "resumed from" "$run/resume.log" && test -f "$run/checkpoints/step_4/dcp/.metadata" \
    || { echo "gpu_check: FAILED: the resume did not reach step 4"; exit 1; }
echo "== 2. 8B layer shapes: one GPU, fp32 masters, bf16 compute"
timeout 270 python3 -m torch.distributed.run --standalone --nproc-per-node=1 bench/gpu_check.py --seqs 4 --steps 2 --turns 20
echo "gpu_check: OK"
