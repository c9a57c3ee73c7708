#!/usr/bin/env bash
# The start of +experiment=cpu_reference (checkpoints/tiny_sft_reference), in one command (~65 min on 2 cores):
# the default start's pocket stage (checkpoints/tiny_sft_pockets4: pocket thoughts at depth 8, the visual
# auxiliary target, 4,096 steps = 8,192 mazes x 2) trained 6,144 steps longer, in two runs:
#  1. 2,048 steps: a third pass over the pocket stage's own 8,192 mazes (trainer.seed=0 draws the same stream),
#     lr 1e-3 on a cosine to 0 (~20 min);
#  2. 4,096 steps: 16,384 new mazes once (trainer.seed=1), lr 5e-4 on a cosine to 0 (~44 min, building the
#     conversations included).
# No second stage and no pick: this start already acts on what it reads (the default job's start is made not to,
# sweeps/make_start.sh). Why these steps and not a deeper thought: results/reading_levers.md.
#
#   bash sweeps/make_reference_start.sh [OUT [FROM [ENV_KEY=VALUE ...]]]   # OUT defaults to outputs/reference_start;
#       the start lands in OUT/start; FROM defaults to checkpoints/tiny_sft_pockets4; env keys (env=..., env.*=...:
#       the observation and distribution FROM was trained on; sweeps/make_start.sh passes its own) go to both runs.
# It is stage 2 of sweeps/make_start.sh, which makes the default start from this one.
# Each run resumes from its last checkpoint (trainer.resume=auto), so a rerun after an interruption continues.
set -euo pipefail
out=$(realpath -m "${1:-outputs/reference_start}")
from=$(realpath -m "${2:-checkpoints/tiny_sft_pockets4}")
shift $(( $# > 1 ? 2 : $# ))
for kv in "$@"; do  # the runs' lengths and seeds are the recipe: only the environment may change
    [[ $kv == env=* || $kv == env.* ]] || { echo "make_reference_start: only env keys may follow FROM ($kv)" >&2; exit 2; }
done
cd "$(dirname "$0")/.."
[[ -f $from/config.json ]] || { echo "make_reference_start: $from holds no policy (no config.json)" >&2; exit 1; }
t0=$SECONDS
python train.py algo=sft model.path="$from" algo.sft_lookahead=8 algo.sft_mazes=8192 algo.sft_epochs=1 \
    algo.lr=1e-3 algo.sft_aux_weight=1 trainer.eval_every=512 'trainer.eval_suites=[select64]' \
    trainer.save_every=512 trainer.keep_last=10 hydra.run.dir="$out/longer1" "$@"
echo "run 1 (2,048 steps): $((SECONDS - t0)) s"
python train.py algo=sft model.path="$out/longer1/checkpoints/step_2048/policy" algo.sft_lookahead=8 \
    algo.sft_mazes=16384 algo.sft_epochs=1 algo.lr=5e-4 algo.sft_aux_weight=1 trainer.seed=1 \
    trainer.eval_every=1024 'trainer.eval_suites=[select64]' trainer.save_every=1024 trainer.keep_last=10 \
    hydra.run.dir="$out/longer2" "$@"
rm -rf "$out/start"
cp -r "$out/longer2/checkpoints/step_4096/policy" "$out/start"
echo "start: $out/start ($((SECONDS - t0)) s in all); use it with: python train.py +experiment=cpu_reference model.path=$out/start"
