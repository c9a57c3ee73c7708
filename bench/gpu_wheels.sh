#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the GPU machine, whose stack has torch, transformers, tensorboard, numpy,
# pillow and safetensors but not Hydra or gymnasium: saved to .whl/ (git-ignored; under 1 MiB), for Python 3.12 on x86-64.
# Carry .whl with the check.   bash bench/gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
    hydra-core==1.3.8 omegaconf==2.3.1 gymnasium==1.4.0 cloudpickle==3.1.3 farama-notifications==0.0.6
# antlr4-python3-runtime 4.9.3 (omegaconf's parser) is published as a source tarball only: build its wheel here
python3 -m pip wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
ls -la .whl
du -sh .whl
