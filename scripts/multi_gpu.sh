#!/usr/bin/env bash
# The multi-GPU training matrix (docs/RESULTS.md, "Two and four GPUs") on one host of 4 GPUs, in
# one go: builds Horovod with NCCL (scripts/build_horovod_gpu.sh), then
#   phase 1, two 2-GPU lanes at once on disjoint GPU pairs: GPUs 0,1 run the NVLink configs, then
#            the GPU tests ($GPU_TESTS, NCCL); GPUs 2,3 run the sockets configs (NCCL_P2P_DISABLE=1
#            NCCL_SHM_DISABLE=1), after profiling $TRACE_IDS (bench train --trace; scripts/plot_trace.py
#            reads the traces); each lane first runs the exchange benchmark on its network
#            ($EXCHANGE_ARGS; empty: skipped), then the issue's main rows, the rest after;
#   phase 2, all 4 GPUs: the 4-rank rows, sockets first.
# The method lists below are the full matrix; each can be replaced from the environment.
# Each phase stops at its deadline (seconds from the start: PHASE1_END, END); a stopped `bench train`
# ends its running job and keeps every finished row (its CSV resumes). Results go to $RESULTS
# (default /tmp/mgpu): one `bench train` folder per lane and N, the tests' log, the GPU topology.
# Wheels needed offline sit in $WHEELS (default .gpu), as for scripts/gpu_suite.sh.
#   bash scripts/multi_gpu.sh
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
R="${RESULTS:-/tmp/mgpu}"; mkdir -p "$R"
WHEELS="${WHEELS:-$ROOT/.gpu}"
PHASE1_END="${PHASE1_END:-1000}"; END="${END:-1500}"
T0=$(date +%s)
left() { echo $(( $1 - ($(date +%s) - T0) )); }
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --target /tmp/np "$WHEELS"/numpy-2.4.6-*.whl
export PYTHONPATH="/tmp/np:$ROOT"
nvidia-smi topo -m > "$R/topology.txt" 2>&1
nvidia-smi --query-gpu=index,name,memory.total --format=csv >> "$R/topology.txt" 2>&1
[[ -f /tmp/hvd_gpu_build/env.sh ]] || bash scripts/build_horovod_gpu.sh "$WHEELS/horovod-0.28.1.tar.gz" \
    > "$R/build.txt" 2>&1 || { echo "build failed: $R/build.txt"; exit 1; }
source /tmp/hvd_gpu_build/env.sh
MODELS="${MODELS:-resnet50,vgg16,vit_b_16}"
# The matrix; each list may be overridden from the environment (a later run's extra rows):
NVLINK_FIRST="${NVLINK_FIRST-single,hvd-fp32,ddp-fp32,hvdq-qsgd4-auto,stock-qsgd4}"
NVLINK_REST="${NVLINK_REST-hvdq-qsgd4-allgather,hvdq-qsgd4-sra,hvdq-qsgd8-auto,hvdq-onebit-allgather,hvd-fp16,ddp-fp16,ddp-powersgd4}"
NVLINK_REST_NETWORK="${NVLINK_REST_NETWORK:-nvlink}"   # sockets: GPUs 0,1 take part of the sockets rows
# (not for timings: two sockets lanes share the host; with them at once, RESULTS.md "Two GPUs again"
# read the unchanged peers 12-28% low)
SOCKETS_FIRST="${SOCKETS_FIRST-ddp-fp32,ddp-fp16,ddp-powersgd4,hvd-fp32,hvd-fp16,stock-qsgd4,hvdq-qsgd4-auto,hvdq-qsgd4-allgather}"
SOCKETS_REST="${SOCKETS_REST-hvdq-qsgd4-sra,hvdq-qsgd8-auto,hvdq-onebit-allgather}"
TRACE_IDS="${TRACE_IDS-resnet50/sockets/hvdq-qsgd4-allgather}"    # profiled (bench train --trace)
GPU_TESTS="${GPU_TESTS-tests/test_torch_gpu.py}"
EXCHANGE_ARGS="${EXCHANGE_ARGS---iters 5}"     # python -m hvd_quant.bench exchange --device cuda ARGS
N4_FIRST="${N4_FIRST-hvd-fp32,hvdq-qsgd4-auto,hvdq-qsgd4-sra,hvdq-qsgd4-allgather}"        # sockets, then NVLink
N4_REST="${N4_REST-hvd-fp32,ddp-fp32,hvd-fp16,hvdq-qsgd4-auto,hvdq-qsgd4-sra,hvdq-qsgd4-allgather,hvdq-qsgd8-auto,hvdq-onebit-allgather}"
N4_MODELS="${N4_MODELS:-resnet50,vgg16}"
bench() {   # bench SECONDS_LEFT_UNTIL ARGS...: one `bench train` run, stopped (SIGINT) at the deadline
  local until=$1; shift
  local s; s=$(left "$until"); (( s > 30 )) || return 0
  timeout -s INT "$s" python3 -m hvd_quant.bench train --num-iters 5 --timeout 150 --no-plot "$@"
}
lane() {    # lane GPUS NETWORK FIRST REST [REST_NETWORK]: sockets profiles first, NVLink tests after FIRST
  export CUDA_VISIBLE_DEVICES=$1
  if [[ -n "$EXCHANGE_ARGS" ]]; then
    s=$(left "$PHASE1_END"); (( s > 60 )) && (
      [[ $2 == sockets ]] && export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
      timeout -s INT "$s" horovodrun -np 2 -H localhost:2 python3 -m hvd_quant.bench exchange \
          --device cuda --json "$R/exchange-$2.json" $EXCHANGE_ARGS > "$R/exchange-$2.txt" 2>&1 )
  fi
  if [[ $2 == sockets && -n "$TRACE_IDS" ]]; then
    bench "$PHASE1_END" --np 2 --networks sockets --models "$MODELS" --out "$R/n2-traces" --trace \
        --only "$TRACE_IDS" --num-iters 2 \
        --methods "$(tr ',' '\n' <<< "$TRACE_IDS" | cut -d/ -f3 | sort -u | paste -sd,)"
  fi
  [[ -n "$3" ]] && bench "$PHASE1_END" --np 2 --networks "$2" --models "$MODELS" --out "$R/n2-$2" --methods "$3"
  if [[ $2 == nvlink && -n "$GPU_TESTS" ]]; then
    s=$(left "$PHASE1_END"); (( s > 60 )) && timeout -s INT "$s" python3 -m pytest $GPU_TESTS \
        -ra -q -p no:cacheprovider > "$R/gpu_tests.txt" 2>&1
  fi
  [[ -n "$4" ]] && bench "$PHASE1_END" --np 2 --networks "${5:-$2}" --models "$MODELS" --out "$R/n2-$2" --methods "$4"
}
echo "phase 1 (2 GPUs, two lanes) from $(date +%T)"
lane 0,1 nvlink "$NVLINK_FIRST" "$NVLINK_REST" "$NVLINK_REST_NETWORK" > "$R/lane-nvlink.txt" 2>&1 &
lane 2,3 sockets "$SOCKETS_FIRST" "$SOCKETS_REST" > "$R/lane-sockets.txt" 2>&1 &
wait
echo "phase 2 (4 GPUs) from $(date +%T)"
unset CUDA_VISIBLE_DEVICES
{
  [[ -n "$N4_FIRST" ]] && bench "$END" --np 4 --networks sockets,nvlink --models "$N4_MODELS" --out "$R/n4" \
      --methods "$N4_FIRST"
  [[ -n "$N4_REST" ]] && bench "$END" --np 4 --networks sockets,nvlink --models "$N4_MODELS,vit_b_16" \
      --out "$R/n4" --methods "$N4_REST"
} > "$R/phase-4gpu.txt" 2>&1
echo "done at $(date +%T)"
