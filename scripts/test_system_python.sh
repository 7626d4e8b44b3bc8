#!/usr/bin/env bash
# The checkpoint-resume tests under the machine's system interpreter /usr/bin/python3, in its own environment
# `.venv-system` (created once by scripts/setup_env.sh, then reused). The suite's `.venv` is usually built
# from another Python (pyenv, uv); the system one is what many users resume on, and Python versions differ
# in how they pickle DCP's metadata (Debian 12's 3.11.2 writes enums as getattr(EnumClass, NAME)).
# Skipped (exit 0, with a message) where there is no /usr/bin/python3 or it cannot create environments.
# Extra arguments go to pytest.
#   DS41_SYSTEM_PYTHON   the interpreter (default: /usr/bin/python3)
#   DS41_SYSTEM_VENV     its environment (default: <repo>/.venv-system)
set -euo pipefail
cd "$(dirname "$0")/.."
system_python="${DS41_SYSTEM_PYTHON:-/usr/bin/python3}"
if [ ! -x "$system_python" ]; then
  echo "test_system_python: skipped, there is no $system_python"
  exit 0
fi
venv="${DS41_SYSTEM_VENV:-$PWD/.venv-system}"
if [ ! -x "$venv/bin/python" ] && ! "$system_python" -c "import ensurepip, venv" >/dev/null 2>&1; then
  echo "test_system_python: skipped, $system_python cannot create a virtual environment" \
       "(on Debian/Ubuntu: apt-get install python3-venv)"
  exit 0
fi
export DS41_PYTHON="$system_python" DS41_VENV="$venv"
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# one worker per core up to 2, a file per worker: the resume file (torchrun launches) takes most of the time
cores=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
workers=$(( cores < 2 ? 1 : 2 ))
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / workers ))}
  set -- -n "$workers" --dist loadfile "$@"
fi
echo "test_system_python: $(python --version) $(python -c 'import torch; print("torch", torch.__version__)')"
# what differs between Python builds: DCP's pickled metadata, written by one interpreter and read by another
python -m pytest -q tests/test_checkpoint_metadata_pickle.py tests/test_training_resume.py \
  -k "pickle or bit_identically" "$@"
