#!/usr/bin/env bash
# The README's main job: set up, then fine-tune the embedded tiny default on CPU with 2 gloo ranks
# (EP 2, 2 Engram owners, 100 updates, validation at 50 and 100). Extra arguments are recipe overrides.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
exec torchrun --standalone --nproc_per_node 2 examples/finetune.py examples/configs/tiny_cpu.yaml "$@"
