#!/usr/bin/env bash
# The study behind results/README.md: the default job (`python train.py`, GRPO from checkpoints/tiny_sft) over
# 3 seeds, then greedy evaluation of the start and of each seed's final checkpoint on every frozen suite but
# select*, with the sweeps beside it: the lr schedule (cosine, the default, against constant) and group size 8,
# 3 seeds each, chosen on select64, and KL (one seed). One job at a time on 2 cores: ~9 min a default job,
# ~17 min at group size 8, ~10 min with a KL reference, ~20 min of evaluation: about 2 h 40 min. This script reruns
# all of them on the current start and writes results/README.md without the committed provenance notes
# (results/provenance.md says how each committed number was produced: the committed sweeps ran on the previous
# start and sit in results/previous_start_*; this script's land in results/lr_schedule, group_size and kl).
set -euo pipefail
cd "$(dirname "$0")/.."
python train.py -m trainer.seed=0,1,2 'trainer.eval_suites=[select64,fixed64]' hydra.sweep.dir=multirun/study_seeds
python train.py -m trainer.seed=0,1,2 algo.lr_schedule=cosine,constant 'trainer.eval_suites=[select64,fixed64]' \
    hydra.sweep.dir=multirun/study_lr_schedule  # the default's schedule, chosen on select64
python train.py -m trainer.seed=0,1,2 algo.group_size=8 'trainer.eval_suites=[select64,fixed64]' \
    hydra.sweep.dir=multirun/study_group_size  # chosen or not on select64 against the default's seeds
python train.py -m algo.kl_coef=0.01 algo.kl_estimator=k3 hydra.sweep.dir=multirun/study_kl
python sweeps/study.py --seeds multirun/study_seeds --start checkpoints/tiny_sft \
    --sweep lr_schedule=multirun/study_lr_schedule:select64 \
    --sweep group_size=multirun/study_lr_schedule+multirun/study_group_size:select64 \
    --sweep kl=multirun/study_seeds+multirun/study_kl --out results
