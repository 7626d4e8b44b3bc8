#!/usr/bin/env bash
# Installs deepseek_v41 with its test/dev extras into the current Python. Uses the installed torch when there is
# one (GPU machines bring their own CUDA build); otherwise pins the CPU build this workplace serves locally.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch" 2>/dev/null || python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[dev]"
