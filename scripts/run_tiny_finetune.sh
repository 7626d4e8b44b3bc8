#!/usr/bin/env bash
# The README's main job: set up `.venv` (scripts/setup_env.sh; the package's dependencies are all the demo
# needs), then fine-tune the embedded tiny default on CPU with 2 gloo ranks (EP 2, 2 Engram owners, 100
# updates, validation before the first and at 50 and 100), export the trained model to runs/tiny_cpu/model and
# load it back from there (trust_remote_code=True, without the package): a greedy continuation and the
# validation accuracy before and after. Extra arguments are recipe overrides (checked once before any worker
# starts); `examples/finetune.py` starts the recipe's 2 worker processes with torchrun itself.
set -euo pipefail
cd "$(dirname "$0")/.."
DS41_EXTRAS="${DS41_EXTRAS-}"  # no extras: the package's own dependencies run the demo
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=1
exec python examples/finetune.py examples/configs/tiny_cpu.yaml "$@"
