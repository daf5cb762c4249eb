#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up the environment (scripts/bootstrap.sh, seconds
# when already done), then runs pytest on real multi-process Horovod jobs (Gloo and MPI on CPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k codec -x`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
exec "$ROOT/.venv/bin/python" -m pytest tests -ra --durations=15 --timeout=1200 "$@"
