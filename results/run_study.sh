#!/usr/bin/env bash
# The CPU reproduction study behind results/README.md (tiny Qwen3-VL: shipped SFT start -> GRPO), old protocol.
# It reproduces those numbers only at the commit they were made at (9a56d14: its fixed64, start and defaults);
# on today's defaults it runs the current default job. The current study: results/default_job/README.md.
# Jobs run one at a time on both cores (two at once on 2 cores measured slower in total): ~17 min a
# default job, ~30 min at group size 8, ~18 min with a KL reference; then
# ~55 min of evaluation (4 checkpoints x 9 suites, ~15 min for the start). results/provenance.md says how the committed
# numbers were produced.
set -euo pipefail
cd "$(dirname "$0")/.."
# 1. the default job over 3 seeds
python train.py -m trainer.seed=0,1,2 hydra.sweep.dir=multirun/study_seeds
# 2. group size and KL (seed 0 each on this machine; the committed sweeps in conf/sweep add seeds)
python train.py -m algo.group_size=8 hydra.sweep.dir=multirun/study_group_size
python train.py -m algo.kl_coef=0.01 algo.kl_estimator=k1,k3 hydra.sweep.dir=multirun/study_kl
# 3. evaluate the start and every final checkpoint on the frozen suites; tables, failures, curves
python sweeps/study.py --seeds multirun/study_seeds --start checkpoints/tiny_sft \
    --sweep group_size=multirun/study_seeds+multirun/study_group_size \
    --sweep kl=multirun/study_seeds+multirun/study_kl --notes results/provenance.md --out results
