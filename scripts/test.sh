#!/usr/bin/env bash
# The whole test suite, from a fresh machine: sets up the environment (scripts/bootstrap.sh, seconds
# when already done), then runs pytest on real multi-process Horovod jobs (Gloo and MPI on CPU).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k codec -x`.
# `bash scripts/test.sh --quick`: the fast tier only (pytest -m quick; tests/conftest.py lists it):
# a few cases of every area and real 2-rank Horovod jobs. CI (.ci/run) runs the whole suite.
# Both run on two pytest-xdist workers (-n 2; the tests that read one background child share a worker,
# tests/children.py); `-n 0` after the script's name runs everything in one process.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# HVD_QUANT_TF=2.19 or 2.20: against that TensorFlow with tf_keras (scripts/bootstrap.sh).
bash "$ROOT/scripts/bootstrap.sh"
cd "$ROOT"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
VENV="$ROOT/.venv"
if [[ "${HVD_QUANT_TF:-2.15}" != 2.15 ]]; then
  VENV="$ROOT/.venv-tf$HVD_QUANT_TF"
  export TF_USE_LEGACY_KERAS=1
fi
ARGS=()
for a in "$@"; do
  if [[ "$a" == --quick ]]; then ARGS+=(-m quick); else ARGS+=("$a"); fi
done
exec "$VENV/bin/python" -m pytest tests -ra --durations=15 --timeout=1200 -n 2 --dist loadgroup --no-loadscope-reorder \
  ${ARGS[@]+"${ARGS[@]}"}
