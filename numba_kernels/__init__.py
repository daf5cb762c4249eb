"""Framework-free Numba kernels (CPU and CUDA) for bucketed quantization, each beside a NumPy reference.

* :mod:`numba_kernels.wire` -- the payload format (header, layout), pure Python.
* :mod:`numba_kernels.reference` -- ``*_ref``: the NumPy specification.
* :func:`prepare` -- one prepared op per codec and kind, on the CPU or a CUDA device, with the same
  signature on both::

      encode             (x, payload, header, key, stream=None, residual=None)
      decode             (payload, out, stream=None, status=None, expect=None)
      decode_sum         (payloads, n, out, stream=None, status=None, expect=None)
      reduce_requantize  (payloads, n, residual, out_payload, header, key, stream=None, status=None, expect=None)
      decode_chunks      (gathered, out, stream=None, status=None, name_hashes=None, expect=None)

  QSGD and 1-bit have all five (the fused three: SRA's phases 2 and 3, the allgather's sum), SortQuant
  and KMeans encode and decode. Each op has the semantics of its ``*_ref`` twin and gives the same bytes
  and float32 values, bit for bit (tests/test_kernels.py, tests/test_fused_kernels.py). A prepared op
  belongs to its caller: it writes its parameter buffer (and, on a device, its scratch) on every call,
  so one op serves one thread. An op whose arrays are pointers (the CPU's, QSGD's and 1-bit's on a
  device) has ``bind(converters, ...)``: the per-step closure that ``hvd_quant``'s ``Codec.bind_*`` return.
* :mod:`numba_kernels.cpu` and :mod:`numba_kernels.cuda` -- the ops (modules per codec: see
  docs/ARCHITECTURE.md). ``cuda`` is imported on first use, so that ``numba.cuda`` is not imported
  (and ``NUMBA_ENABLE_CUDASIM`` may still be set) until someone asks for a CUDA op.
* ``_scalar`` -- the scalar math, written once and compiled for both.

No torch, TensorFlow or Horovod imports here.

CPU threads: Numba's pool takes every core by default, in every process, so several Horovod ranks
on one host oversubscribe it (every step slows down, even one that runs no kernel). Unless
``NUMBA_NUM_THREADS`` is set, importing this package before Numba sets it to this process's cores
divided by the ranks on the host (``HOROVOD_LOCAL_SIZE`` from horovodrun,
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
from . import reference
from .reference import *  # noqa: F401,F403 - the NumPy specification (``*_ref``) at the package root

__all__ = ["prepare", "wire", "PayloadError", *reference.__all__]


def prepare(method, kind, device, numel, **params):
    """The prepared op ``kind`` (see above) of codec ``method`` ("qsgd", "onebit", "sortquant",
    "kmeans") for ``numel`` elements, on a CUDA device (``device`` true) or the CPU. ``params``: the
    codec's configuration as the kernels take it, ints and bools named as in docs/CODECS.md's table
    ("Kernels"; a ``bucket_size`` of 0 or None is one bucket per tensor where the codec allows it)."""
    table = importlib.import_module(f"{__name__}.{'cuda' if device else 'cpu'}").PREPARE
    make = table.get((method, kind))
    if make is None:
        raise ValueError(f"no {kind!r} op for {method!r} on the {'CUDA device' if device else 'CPU'}; "
                         f"there are: {sorted(table)}")
    return make(int(numel), **{k: int(v or 0) for k, v in params.items()})


def __getattr__(name):
    if name not in ("cpu", "cuda", "reference"):
        raise AttributeError(f"module 'numba_kernels' has no attribute {name!r}")
    return importlib.import_module(f"{__name__}.{name}")
