#!/usr/bin/env bash
# A world-size-1 forced step per configuration (scripts/ws1_sweep.py, one process each), on a CUDA
# machine. Builds Horovod first when needed (scripts/build_horovod_gpu.sh; wheels in .gpu as for
# scripts/gpu_suite.sh), then runs each line of CONFIGS and appends the results to $OUT/sweep.txt.
#   bash scripts/ws1_sweep.sh CONFIGS
# A line of CONFIGS: extra environment (ENV=VALUE[,ENV=VALUE], or - for none), then ws1_sweep.py's
# arguments ($OUT is expanded), e.g.
#   HOROVOD_CYCLE_TIME=0.1 --method sra --bucket-mb 4
#   - --method fp32 --model vgg16 --cprofile $OUT/cp-fp32.txt
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"; cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-out}"; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/np .gpu/numpy-2.4.6-*.whl
export PYTHONPATH="/tmp/np:$ROOT"
[[ -f /tmp/hvd_gpu_build/env.sh ]] || bash scripts/build_horovod_gpu.sh .gpu/horovod-0.28.1.tar.gz > "$OUT/build.txt" 2>&1 || { tail -30 "$OUT/build.txt"; exit 1; }
source /tmp/hvd_gpu_build/env.sh
while read -r envs args; do
  [[ -z "$args" ]] && continue
  [[ "$envs" == - ]] && envs=""
  echo "== $envs $args"
  env HOROVOD_ELASTIC=1 ${envs//,/ } timeout 120 python3 scripts/ws1_sweep.py $(eval echo $args) 2>&1 | grep -E 'WS1|Error|error' | tail -3
done < "${1:-/dev/stdin}" | tee -a "$OUT/sweep.txt"
