#!/usr/bin/env bash
# The default GRPO start (checkpoints/tiny_sft) from a random tiny Qwen3-VL, in one command (~43 min on 2 cores).
#
#   bash sweeps/make_start.sh [OUT [KEY=VALUE ...]]   # OUT defaults to outputs/tiny_start; the start lands in
#                                                      # OUT/start; KEY=VALUEs go to stage 1 (a reading lever),
#                                                      # and the env ones (env=..., env.*=...) to stage 2 as well
#
# The generalist's start (+experiment=cpu_generalist) is stage 1 continued from this one's pocket stage on the
# training mixture conf/env/maze_mix.yaml, then the same stage 2 and pick on that mixture (~41 min):
#   bash sweeps/make_start.sh outputs/generalist_start env=maze_mix model.path=checkpoints/tiny_sft_pockets4 \
#       algo.sft_mazes=8192 algo.sft_epochs=1 algo.lr=1e-3
#
# Two SFT stages, because one does not make a start GRPO can lift (results/reference_task_probes.md):
#  1. pocket thoughts: the BFS expert, thinking first, its thought naming the open ways and which of them enter
#     a dead-end pocket (algo.sft_lookahead=8); 8,192 mazes x 2 epochs (~35 min). A visual auxiliary target
#     (algo.sft_aux_weight=1) asks a fixed readout of the agent's image token for the same truth, so the gradient
#     reaches the vision tower directly. This is checkpoints/tiny_sft_pockets4.
#  2. reading without acting: 256 steps from stage 1 with the greedy expert (depth-first toward the goal, which
#     enters pockets), the thought unchanged (~4 min). Its thought still names the pockets; its moves ignore them.
# GRPO at CPU scale teaches a policy to act on what its network already reads, not the reading itself: stage 2
# leaves exactly that part to learn. The start is stage 2's checkpoint (step 128 or 256) that sweeps/pick_start.py
# chooses on select64, never fixed64: greedy rate nearest 0.45 among those whose sampled groups are mixed often.
# Each stage resumes from its last checkpoint (trainer.resume=auto), so a rerun after an interruption continues.
set -euo pipefail
out=$(realpath -m "${1:-outputs/tiny_start}")
shift $(( $# > 0 ? 1 : 0 ))
cd "$(dirname "$0")/.."
t0=$SECONDS
python train.py algo=sft model.path=null algo.sft_lookahead=8 algo.sft_mazes=8192 algo.sft_aux_weight=1 \
    trainer.eval_every=512 'trainer.eval_suites=[select64]' trainer.save_every=512 trainer.keep_last=10 \
    hydra.run.dir="$out/pockets" "$@"
n=-1  # stage 1's last checkpoint (4,096 steps by default; fewer when KEY=VALUEs change the data)
for d in "$out"/pockets/checkpoints/step_*/; do s=${d%/}; s=${s##*step_}; [[ $s =~ ^[0-9]+$ ]] && (( s > n )) && n=$s; done
pockets="$out/pockets/checkpoints/step_$n/policy"
[[ -d $pockets ]] || { echo "make_start: stage 1 left no $pockets" >&2; exit 1; }
env_keys=()  # the training distribution and observation: stage 2 reads what stage 1 read
for kv in "$@"; do [[ $kv == env=* || $kv == env.* ]] && env_keys+=("$kv"); done
echo "stage 1 (pocket thoughts): $((SECONDS - t0)) s"
t1=$SECONDS
python train.py algo=sft model.path="$pockets" algo.sft_expert=greedy \
    algo.sft_lookahead=8 algo.sft_mazes=1024 algo.sft_epochs=1 algo.lr=5e-4 trainer.seed=2 trainer.eval_every=128 \
    'trainer.eval_suites=[select64,fixed64]' trainer.save_every=128 hydra.run.dir="$out/greedy" \
    ${env_keys[@]+"${env_keys[@]}"}
echo "stage 2 (reading without acting): $((SECONDS - t1)) s"
rm -rf "$out/start"
python sweeps/pick_start.py "$out/greedy" --steps 128,256 --out "$out/start"
echo "start: $out/start ($((SECONDS - t0)) s in all); use it with: python train.py model.path=$out/start"
