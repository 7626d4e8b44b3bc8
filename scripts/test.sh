#!/usr/bin/env bash
# The test command of the README (and of CI): set up, then run the whole suite (GPU tests skip on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"
