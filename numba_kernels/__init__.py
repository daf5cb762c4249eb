"""Framework-free Numba kernels (CPU and CUDA) for bucketed quantization, each beside a NumPy reference.

* :mod:`numba_kernels.wire` -- the payload format (header, layout), pure Python.
* :mod:`numba_kernels.reference` -- ``*_ref``: the NumPy specification.
* :mod:`numba_kernels.cpu` -- ``*_cpu`` and ``prepare_*``: the CPU launch layer over
  ``njit(parallel=True, cache=True)`` kernels, one module per codec (``_cpu_qsgd``, ``_cpu_onebit``,
  ``_cpu_sortquant``, ``_cpu_kmeans``, ``_cpu_half``) on shared parts (``_cpu_base``).
* :mod:`numba_kernels.cuda` -- ``*_cuda`` and ``prepare_*``: ``numba.cuda`` kernels (also run in the
  CUDA simulator): the launch layer (``_cuda_launch``), the prepared launches (``_cuda_prepared``), the
  kernels per path and codec (``_cuda_warp``, ``_cuda_block``, ``_cuda_sortquant``, ``_cuda_kmeans``).
* ``_scalar`` -- the scalar math, written once and compiled for both.

A ``prepare_*`` function returns a launch its caller owns: it writes its parameter buffer (and, on
a device, its scratch) on every call, so one launch serves one thread; the plain ``*_cpu`` /
``*_cuda`` launchers keep theirs per thread.

Every ``*_cpu`` / ``*_cuda`` launcher has the signature of its ``*_ref`` twin and gives the same bytes
and the same float32 values, bit for bit (tests/test_kernels.py). ``numba_kernels.cuda`` is imported
lazily, on first use, so that ``numba.cuda`` is not imported (and ``NUMBA_ENABLE_CUDASIM`` may still be
set) until someone asks for a CUDA kernel. No torch, TensorFlow or Horovod imports here.

CPU threads: Numba's pool takes every core by default, in every process, so several Horovod ranks
on one host oversubscribe it (2 ranks on 2 cores: training steps about 6x slower, even steps that run
no kernel). Unless ``NUMBA_NUM_THREADS`` is set, importing this package before Numba sets it to this
process's cores divided by the ranks on the host (``HOROVOD_LOCAL_SIZE`` from horovodrun,
``OMPI_COMM_WORLD_LOCAL_SIZE`` from Open MPI's mpirun; nothing when neither is there).
"""
import importlib
import os
import sys


def _share_cores():
    if "NUMBA_NUM_THREADS" in os.environ or "numba" in sys.modules:
        return
    for var in ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE"):
        local = os.environ.get(var, "")
        if local.isdigit() and int(local) > 1:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
            os.environ["NUMBA_NUM_THREADS"] = str(max(1, (cores or 1) // int(local)))
            return


_share_cores()

from . import wire
from .wire import PayloadError
from .reference import (qsgd_encode_ref, qsgd_decode_ref, onebit_encode_ref, onebit_decode_ref,
                        write_header_ref, bucket_scales_ref, lane_sum_ref, header_errors_ref, levels,
                        qsgd_decode_sum_ref, onebit_decode_sum_ref, qsgd_reduce_requantize_ref,
                        onebit_reduce_requantize_ref, qsgd_decode_chunks_ref, onebit_decode_chunks_ref)

__all__ = ["wire", "PayloadError", "levels", "bucket_scales_ref", "lane_sum_ref", "header_errors_ref",
           "qsgd_encode_ref", "qsgd_decode_ref", "onebit_encode_ref", "onebit_decode_ref",
           "write_header_ref",
           "qsgd_encode_cpu", "qsgd_decode_cpu", "onebit_encode_cpu", "onebit_decode_cpu",
           "write_header_cpu",
           "qsgd_encode_cuda", "qsgd_decode_cuda", "onebit_encode_cuda", "onebit_decode_cuda",
           "write_header_cuda", "check_header_cuda",
           # fused: several payloads per launch (SRA's phases 2 and 3, allgather's sum)
           "qsgd_decode_sum_ref", "onebit_decode_sum_ref", "qsgd_reduce_requantize_ref",
           "onebit_reduce_requantize_ref", "qsgd_decode_chunks_ref", "onebit_decode_chunks_ref",
           "qsgd_decode_sum_cpu", "onebit_decode_sum_cpu", "qsgd_reduce_requantize_cpu",
           "onebit_reduce_requantize_cpu", "qsgd_decode_chunks_cpu", "onebit_decode_chunks_cpu",
           "qsgd_decode_sum_cuda", "onebit_decode_sum_cuda", "qsgd_reduce_requantize_cuda",
           "onebit_reduce_requantize_cuda", "qsgd_decode_chunks_cuda", "onebit_decode_chunks_cuda"]

_LAZY = {name: "cpu" for name in __all__ if name.endswith("_cpu")}
_LAZY.update({name: "cuda" for name in __all__ if name.endswith("_cuda")})
_LAZY.update({"cpu": "cpu", "cuda": "cuda", "reference": "reference"})


def __getattr__(name):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'numba_kernels' has no attribute {name!r}")
    m = importlib.import_module(f"{__name__}.{mod}")
    return m if name == mod else getattr(m, name)
