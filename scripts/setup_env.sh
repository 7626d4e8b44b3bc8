#!/usr/bin/env bash
# Creates (or reuses) the repository's virtual environment `.venv` and installs deepseek_v41 into it with the
# extras the README's two commands need. Never installs into the system interpreter (PEP 668 refuses that on
# Debian). Sourced by the two README scripts: afterwards `python` is the environment's interpreter.
#   DS41_PYTHON   the interpreter that creates the environment (default: python3)
#   DS41_VENV     where the environment lives (default: <repo>/.venv)
#   DS41_EXTRAS   the package's extras to install, comma-separated (default: dev, what the tests need;
#                 scripts/run_tiny_finetune.sh asks for none: the demo needs only the package's dependencies).
#                 Extras installed before stay: asking for fewer reuses the environment as it is.
# A torch already installed in that interpreter (a GPU machine's CUDA build) is reused through
# --system-site-packages; otherwise torch==2.13.0 is installed into the environment from the package index.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
base_python="${DS41_PYTHON:-python3}"
venv="${DS41_VENV:-$repo/.venv}"
extras="${DS41_EXTRAS-dev}"

if ! command -v "$base_python" >/dev/null 2>&1; then
  echo "setup: '$base_python' not found; install Python 3.10+ or set DS41_PYTHON to an interpreter" >&2
  exit 1
fi
stamp="$venv/.deepseek_v41_installed"
# The stamp holds pyproject.toml's hash and the extras installed: reinstall when pyproject.toml changed or an
# extra is missing, with the extras installed before kept (so the two README scripts never undo each other).
hash="$(sha256sum < "$repo/pyproject.toml" | cut -c1-16)"
old_hash="" old_extras=""
if [ -f "$stamp" ]; then read -r old_hash old_extras < "$stamp" || true; fi
_ds41_sorted() { printf '%s\n' ${1//,/ } | sort -u | paste -sd, -; }
old_extras="$(_ds41_sorted "${old_extras/#-/}")"
union="$(_ds41_sorted "$extras,$old_extras")"
if [ -x "$venv/bin/python" ] && [ "$old_hash" = "$hash" ] && [ "$union" = "$old_extras" ]; then
  echo "setup: reusing $venv"
else
  if [ ! -x "$venv/bin/python" ]; then
    site=()
    if "$base_python" -c "import torch" >/dev/null 2>&1; then
      site=(--system-site-packages)  # keep the machine's torch (a CUDA build) instead of a CPU one
      echo "setup: creating $venv with $($base_python --version 2>&1) (reusing its torch)"
    else
      echo "setup: creating $venv with $($base_python --version 2>&1)"
    fi
    "$base_python" -m venv "${site[@]}" "$venv" || {
      echo "setup: '$base_python -m venv' failed; on Debian/Ubuntu install python3-venv (apt-get install python3-venv)" >&2
      exit 1
    }
  fi
  py="$venv/bin/python"
  if ! "$py" -c "import torch" >/dev/null 2>&1; then
    echo "setup: installing torch 2.13.0 into $venv ..."
    "$py" -m pip install -q "torch==2.13.0"
  fi
  echo "setup: installing deepseek_v41${union:+[$union]} into $venv (about 2 minutes on a fresh machine) ..."
  "$py" -m pip install -q -e "$repo${union:+[$union]}"
  echo "$hash ${union:--}" > "$stamp"
  echo "setup: done"
fi
export PATH="$venv/bin:$PATH" VIRTUAL_ENV="$venv"
