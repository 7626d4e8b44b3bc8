#!/usr/bin/env bash
# The README's main job: set up `.venv` (scripts/setup_env.sh), then fine-tune the embedded tiny default on CPU
# with 2 gloo ranks (EP 2, 2 Engram owners, 100 updates, validation at 50 and 100), export the trained model and
# try it. Extra arguments are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
exec torchrun --standalone --nproc_per_node 2 examples/finetune.py examples/configs/tiny_cpu.yaml "$@"
