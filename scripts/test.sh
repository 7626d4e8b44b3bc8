#!/usr/bin/env bash
# The test command of the README (and of CI): set up `.venv` (scripts/setup_env.sh), then run the whole suite
# (GPU tests skip on CPU), then the checkpoint tests once more under the machine's system Python when that is
# another build (scripts/test_system_python.sh: Debian's /usr/bin/python3 pickles DCP metadata differently).
# Extra arguments go to pytest and skip that second step.
set -euo pipefail
cd "$(dirname "$0")/.."
extra_args=$#
source scripts/setup_env.sh
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Test files run in parallel, one worker per core up to 4 (PYTEST_WORKERS overrides; 0 or 1 runs in one
# process), each worker with its share of the cores: most tests are tiny models that gain little from threads.
# A file's module fixtures stay in one worker (--dist loadfile); files go out in collection order, the longest
# first (tests/conftest.py LONGEST_FILES).
cores=$(python -c "import os; print(len(os.sched_getaffinity(0)))")
workers=${PYTEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
if [ "$workers" -gt 1 ]; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cores / workers ))}
  set -- -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
fi
echo "test: python -m pytest -q $*"
python -m pytest -q "$@"
if [ "$extra_args" -eq 0 ] && [ -x /usr/bin/python3 ] && \
   [ "$(/usr/bin/python3 -c 'import sys; print(sys.version)')" != "$(python -c 'import sys; print(sys.version)')" ]; then
  bash scripts/test_system_python.sh
fi
