#!/usr/bin/env bash
# The default GRPO start (checkpoints/tiny_sft) from a random tiny Qwen3-VL, in one command (~110 min on 2 cores).
#
#   bash sweeps/make_start.sh [--skip-longer] [OUT [KEY=VALUE ...]]
#       OUT defaults to outputs/tiny_start; the start lands in OUT/start. KEY=VALUEs go to stage 1 (a reading
#       lever); the env ones (env=..., env.*=...) to every later stage as well, the others to stage 1 only: stage 2
#       runs its own fixed recipe on top, so a lever measured through the whole start wants --skip-longer (or the
#       same keys given to make_reference_start.sh's runs by hand). --skip-longer leaves out stage 2.
#
# The generalist's start (+experiment=cpu_generalist, checkpoints/tiny_sft_mix) is stage 1 continued from the
# 9x9 pocket stage on the training mixture conf/env/maze_mix.yaml, then stages 3 and 4 on that mixture (~41 min):
#   bash sweeps/make_start.sh --skip-longer outputs/generalist_start env=maze_mix \
#       model.path=checkpoints/tiny_sft_pockets4 algo.sft_mazes=8192 algo.sft_epochs=1 algo.lr=1e-3
#
# Three SFT stages and a pick, because one SFT run does not make a start GRPO can lift
# (results/reference_task_probes.md):
#  1. pocket thoughts: the BFS expert, thinking first, its thought naming the open ways and which of them enter
#     a dead-end pocket (algo.sft_lookahead=8); 8,192 mazes x 2 epochs (~35 min). A visual auxiliary target
#     (algo.sft_aux_weight=1) asks a fixed readout of the agent's image token for the same truth, so the gradient
#     reaches the vision tower directly. This is checkpoints/tiny_sft_pockets4.
#  2. reading longer: the same SFT 6,144 steps more, a third pass over stage 1's mazes then 16,384 new ones
#     (sweeps/make_reference_start.sh, ~65 min). It reads pockets better (named right on 0.91 of turns on fresh
#     mazes against 0.85) and solves more by SFT alone. This is checkpoints/tiny_sft_reference (cpu_reference's).
#  3. reading without acting: 256 steps with the greedy expert (depth-first toward the goal, which enters
#     pockets), the thought unchanged (~4 min). Its thought still names the pockets; its moves ignore them.
#  4. the pick: sweeps/pick_start.py chooses stage 3's checkpoint (step 128 or 256) on select64, never fixed64:
#     greedy rate nearest 0.45 among those whose sampled GRPO groups have mixed outcomes often enough.
# GRPO at CPU scale teaches a policy to act on what its network already reads, not the reading itself: stage 3
# leaves exactly that part to learn, and stage 2 raises how much there is to act on.
# Each stage resumes from its last checkpoint (trainer.resume=auto), so a rerun after an interruption continues.
set -euo pipefail
longer=1
args=()
for a in "$@"; do if [[ $a == --skip-longer ]]; then longer=0; else args+=("$a"); fi; done
set -- ${args[@]+"${args[@]}"}
[[ ${1:-} == *=* ]] && { echo "make_start: the first argument is OUT, not a KEY=VALUE ($1)" >&2; exit 2; }
out=$(realpath -m "${1:-outputs/tiny_start}")
shift $(( $# > 0 ? 1 : 0 ))
cd "$(dirname "$0")/.."
last_policy() {  # the policy of a run's last checkpoint (use as a plain assignment, x=$(...), so a failure stops)
    local n=-1 d s
    for d in "$1"/checkpoints/step_*/; do s=${d%/}; s=${s##*step_}; [[ $s =~ ^[0-9]+$ ]] && (( s > n )) && n=$s; done
    [[ -d $1/checkpoints/step_$n/policy ]] || { echo "make_start: $1 left no checkpoint" >&2; return 1; }
    echo "$1/checkpoints/step_$n/policy"
}
env_keys=()  # the training distribution and observation: every stage reads what stage 1 read
for kv in "$@"; do [[ $kv == env=* || $kv == env.* ]] && env_keys+=("$kv"); done
t0=$SECONDS
python train.py algo=sft model.path=null algo.sft_lookahead=8 algo.sft_mazes=8192 algo.sft_aux_weight=1 \
    trainer.eval_every=512 'trainer.eval_suites=[select64]' trainer.save_every=512 trainer.keep_last=10 \
    hydra.run.dir="$out/pockets" "$@"
reader=$(last_policy "$out/pockets")  # 4,096 steps by default; fewer when KEY=VALUEs change the data
echo "stage 1 (pocket thoughts): $((SECONDS - t0)) s"
if (( longer )); then
    bash sweeps/make_reference_start.sh "$out/reading" "$reader" ${env_keys[@]+"${env_keys[@]}"}
    reader="$out/reading/start"
    echo "stage 2 (reading longer): $((SECONDS - t0)) s in all"
fi
t1=$SECONDS
python train.py algo=sft model.path="$reader" algo.sft_expert=greedy \
    algo.sft_lookahead=8 algo.sft_mazes=1024 algo.sft_epochs=1 algo.lr=5e-4 trainer.seed=2 trainer.eval_every=128 \
    'trainer.eval_suites=[select64,fixed64]' trainer.save_every=128 hydra.run.dir="$out/greedy" \
    ${env_keys[@]+"${env_keys[@]}"}
echo "stage 3 (reading without acting): $((SECONDS - t1)) s"
rm -rf "$out/start"
python sweeps/pick_start.py "$out/greedy" --steps 128,256 --out "$out/start"
echo "start: $out/start ($((SECONDS - t0)) s in all); use it with: python train.py model.path=$out/start"
