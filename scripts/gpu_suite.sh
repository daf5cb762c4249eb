#!/usr/bin/env bash
# Everything hvd_quant runs on a GPU machine, in one go (for the device tool, or any CUDA host):
# builds Horovod with NCCL (scripts/build_horovod_gpu.sh), then runs the GPU tests and benchmarks and
# writes their logs to $OUT (default ./gpu-out). Wheels needed offline sit in $WHEELS (default .gpu):
# horovod-0.28.1.tar.gz, cffi + pycparser (Horovod's setup_requires), numpy 2.4.6 (numba-cuda 0.30 fails
# with NumPy 2.5).
#   bash scripts/gpu_suite.sh [steps...]     steps: build tests codec exchange (default: all)
# GPU_TESTS picks the test files of the tests step (default: all of tests/; the device tool's calls
# of 10 minutes take the two-GPU tests, tests/test_torch_gpu.py, in one call and the rest in another).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
OUT="${OUT:-$ROOT/gpu-out}"; mkdir -p "$OUT"
WHEELS="${WHEELS:-$ROOT/.gpu}"
STEPS="${*:-build tests codec exchange}"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/np "$WHEELS"/numpy-2.4.6-*.whl
export PYTHONPATH="/tmp/np:$ROOT"
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
step() { [[ " $STEPS " == *" $1 "* ]]; }
run() { local name=$1; shift; echo "\$ $*" | tee "$OUT/$name.txt"; "$@" 2>&1 | tee -a "$OUT/$name.txt"; }

if step build; then
  run build bash scripts/build_horovod_gpu.sh "$WHEELS/horovod-0.28.1.tar.gz" || exit 1
fi
[[ -f /tmp/hvd_gpu_build/env.sh ]] && source /tmp/hvd_gpu_build/env.sh
if step tests; then
  run tests python3 -m pytest ${GPU_TESTS:-tests} -m "gpu" -ra -q -p no:cacheprovider
fi
if step codec; then
  run codec python3 -m hvd_quant.bench codec --device cuda --numel 100000000 --bucket-size 512
fi
if step exchange && [[ $NGPU -ge 2 ]]; then
  run exchange_nvlink horovodrun -np 2 -H localhost:2 python3 -m hvd_quant.bench exchange --device cuda
  NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 run exchange_sockets \
    horovodrun -np 2 -H localhost:2 python3 -m hvd_quant.bench exchange --device cuda
fi
