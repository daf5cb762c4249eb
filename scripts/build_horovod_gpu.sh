#!/usr/bin/env bash
# Build Horovod 0.28.1 with NCCL + MPI + Gloo for PyTorch on a CUDA machine, following the recipe
# measured in DESIGN.md (Python 3.12, torch 2.x+cu13x, CUDA 13, CMake 4, gcc 13, OpenMPI, NCCL from
# the nvidia-nccl-cu13 wheel). Works offline: pass the Horovod sdist.
#
#   scripts/build_horovod_gpu.sh path/to/horovod-0.28.1.tar.gz [python]
#
# Afterwards source the printed env file (or export LD_LIBRARY_PATH as it says) before running.
set -euo pipefail
SDIST="${1:?usage: $0 horovod-0.28.1.tar.gz [python]}"
PY="${2:-python3}"
WORK="${HVD_BUILD_DIR:-/tmp/hvd_gpu_build}"
log() { printf '[gpu-build %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

rm -rf "$WORK" && mkdir -p "$WORK"
# Horovod's setup.py lists cffi under setup_requires; on an offline machine install it first from
# wheels found next to the sdist (cffi + pycparser), if it is not there already.
if ! "$PY" -c "import cffi" 2>/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps "$(dirname "$SDIST")"/cffi-*.whl "$(dirname "$SDIST")"/pycparser-*.whl
fi
tar -xzf "$SDIST" -C "$WORK"
SRC="$(ls -d "$WORK"/horovod-*/)"

# Source fixes, each needed by today's toolchain (DESIGN.md):
# - PyTorch >= 2.1 headers need C++17; Horovod 0.28.1 asks for C++14 (fixed upstream on master only).
sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$SRC/CMakeLists.txt" "$SRC/horovod/torch/CMakeLists.txt"
# - CUDA 13's nvcc with C++17 host headers rejects the CUDA C++11 standard Horovod pins for its kernels.
sed -i 's/CMAKE_CUDA_STANDARD 11/CMAKE_CUDA_STANDARD 17/' "$SRC/horovod/common/ops/cuda/CMakeLists.txt"

# NCCL from the nvidia-nccl-cu13 wheel: headers in the wheel, and a libnccl.so link for the linker.
NCCL_ROOT="$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(nvidia.nccl.__file__) if nvidia.nccl.__file__ else list(nvidia.nccl.__path__)[0])')"
mkdir -p "$WORK/nccl_lib"
ln -sf "$NCCL_ROOT/lib/libnccl.so.2" "$WORK/nccl_lib/libnccl.so"
log "NCCL from $NCCL_ROOT"

# - CMake 4 refuses the old cmake_minimum_required of Horovod's third-party code.
export CMAKE_POLICY_VERSION_MINIMUM=3.5
# - gcc 13 no longer includes these headers transitively; Horovod's sources rely on them.
export CXXFLAGS="${CXXFLAGS:-} -include cstdint -include string -include stdexcept -include limits -include memory"
export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
export HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED
export HOROVOD_NCCL_INCLUDE="$NCCL_ROOT/include" HOROVOD_NCCL_LIB="$WORK/nccl_lib"
export HOROVOD_BUILD_CUDA_CC_LIST="${HOROVOD_BUILD_CUDA_CC_LIST:-90}"
export MAKEFLAGS="-j$(nproc)"
log "building (this takes about 1.5 minutes on 16 cores)"
"$PY" -m pip install --no-build-isolation --no-deps --no-cache-dir "$SRC" > "$WORK/build.log" 2>&1 \
  || { tail -n 80 "$WORK/build.log"; log "build failed; log: $WORK/build.log"; exit 1; }
echo "export LD_LIBRARY_PATH=$NCCL_ROOT/lib:\${LD_LIBRARY_PATH:-}" > "$WORK/env.sh"
log "built; run with: source $WORK/env.sh"
LD_LIBRARY_PATH="$NCCL_ROOT/lib:${LD_LIBRARY_PATH:-}" "$PY" -m horovod.runner.launch --check-build
