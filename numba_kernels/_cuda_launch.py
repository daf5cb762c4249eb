"""The CUDA launch layer: kernels built once per specialisation (``kernels``), the driver's
``cuLaunchKernel`` with a parameter buffer per prepared launch (:class:`_Raw`), streams, status
words, grids, and the one-block header write and check (see :mod:`numba_kernels.cuda`).
"""
import ctypes
import math
import threading
import warnings

import numpy as np
from numba import cuda, types as nbt

from . import _cuda_block as _B
from . import _cuda_sortquant as _S
from . import _cuda_warp as _W
from ._cuda_device import BLOCK, SIMULATOR


SORTQUANT_MAX_BUCKET = _S.MAX_BUCKET

MAXCH = _B.MAXCH

FUSE_MAX = _B.FUSE_MAX

# The header check and header write are one-block kernels by design: silence Numba's occupancy hint
# for them (a message filter, so Numba's other performance warnings still show).
warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization")

# ---- kernels, built once per specialisation -----------------------------------------------------------

kernels = {}            # (name, *spec) -> dispatcher: what has been built (tests, diagnostics)
_lock = threading.Lock()


def _kernel(name, make, spec):
    key = (name,) + tuple(spec)
    k = kernels.get(key)
    if k is None:
        with _lock:
            k = kernels.get(key)
            if k is None:
                k = kernels[key] = make(spec)
    return k


def _header_kernel():
    kernels.setdefault(("header",), _B.k_header)
    return _B.k_header


def _check_kernel():
    kernels.setdefault(("check",), _B.k_check)
    return _B.k_check


def kernel_path(bits, bucket_size, numel):
    """'warp' or 'block': the kernel path a configuration takes (bucket_size 0: one bucket)."""
    bs = int(bucket_size) or max(int(numel), 1)
    return "warp" if _W.supported(int(bits), bs, int(numel), FUSE_MAX) else "block"


# ---- direct launches (hardware) -------------------------------------------------------------------------

_SUCCESS, _INVALID_CONTEXT = 0, 201     # CUDA_SUCCESS, CUDA_ERROR_INVALID_CONTEXT


def _driver_launch():
    """The driver's ``cuLaunchKernel`` through ctypes, its argument types declared once (a binding
    that converts its arguments on every call costs several times as much)."""
    for name in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            lib = ctypes.CDLL(name)
            break
        except OSError:
            continue
    else:                                   # pragma: no cover - CUDA works, so the driver is there
        raise RuntimeError("hvd_quant: the CUDA driver library (libcuda) could not be loaded")
    fn = lib.cuLaunchKernel
    u = ctypes.c_uint
    fn.argtypes = [ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


_cu_launch = None if SIMULATOR else _driver_launch()


def _ctype(ty):
    if ty == nbt.boolean:
        return ctypes.c_bool
    if ty == nbt.float32:
        return ctypes.c_float
    if ty == nbt.float64:
        return ctypes.c_double
    return getattr(ctypes, f"c_{ty}")          # int64 -> c_int64, uint64 -> c_uint64, ...


class _Raw:
    """One compiled kernel and its parameter buffer, built once (hardware only).

    Numba passes an array argument as 7 parameters (meminfo, parent, nitems, itemsize, data, shape,
    strides: ``_Kernel._prepare_args``), a tuple as its elements, a scalar as its C type; the buffer
    holds one ctypes object per parameter and ``cuLaunchKernel`` gets the array of their addresses.
    ``sizes[i]``: the element count of array argument ``i`` (``set_size`` changes it: a kernel
    clamps its slices of an array to this count)."""
    __slots__ = ("kern", "handle", "slots", "dims", "_objs", "_params", "addr")

    def __init__(self, disp, sig, sizes):
        self.kern = disp.compile(sig)
        self.handle = int(self.kern._codelibrary.get_cufunc().handle)
        self.slots = []             # per argument: the ctypes objects to update
        self.dims = []              # per argument: an array's (nitems, shape) objects, else None
        objs = []
        for ty, size in zip(sig, sizes):
            if isinstance(ty, nbt.Array):
                item = ty.dtype.bitwidth // 8
                a = [ctypes.c_int64(0), ctypes.c_int64(0), ctypes.c_int64(size), ctypes.c_int64(item),
                     ctypes.c_uint64(0), ctypes.c_int64(size), ctypes.c_int64(item)]
                self.slots.append(a[4])
                self.dims.append((a[2], a[5]))
            elif isinstance(ty, nbt.BaseTuple):
                a = [_ctype(t)(0) for t in ty]
                self.slots.append(a)
                self.dims.append(None)
            else:
                a = [_ctype(ty)(size or 0)]
                self.slots.append(a[0])
                self.dims.append(None)
            objs.extend(a)
        self._objs = objs
        self._params = (ctypes.c_void_p * len(objs))(*[ctypes.addressof(o) for o in objs])
        self.addr = ctypes.addressof(self._params)

    def set_size(self, i, n):
        """Array argument ``i`` holds ``n`` elements."""
        for o in self.dims[i]:
            o.value = n

    def set_payloads(self, i, pointer, n, total):
        """Arguments ``i, i+1, i+2``: ``n`` payloads of ``total`` bytes back to back at ``pointer``, as
        bytes, 32-bit words and float32 (the kernels slice them per payload)."""
        for k, size in ((i, n * total), (i + 1, n * total // 4), (i + 2, n * total // 4)):
            self.slots[k].value = pointer
            self.set_size(k, size)

    def set_tuple(self, i, values):
        for o, v in zip(self.slots[i], values):
            o.value = int(v)

    def launch(self, grid, block, stream):
        err = _cu_launch(self.handle, grid, 1, 1, block, 1, 1, 0, stream or None, self.addr, None)
        if err != _SUCCESS:
            if err == _INVALID_CONTEXT:         # a thread that never used CUDA: make Numba's current
                cuda.current_context()
                err = _cu_launch(self.handle, grid, 1, 1, block, 1, 1, 0, stream or None, self.addr, None)
            if err != _SUCCESS:
                raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def _ptr(a):
    """Device pointer of an array (a Numba device array, a ``__cuda_array_interface__`` object, an int)."""
    if type(a) is int:
        return a
    return a.__cuda_array_interface__["data"][0]


def _stream(stream):
    """A raw CUstream handle (int) from 0/None, an int or a Numba stream."""
    if not stream:
        return 0
    if type(stream) is int:
        return stream
    h = getattr(stream, "handle", None)
    if h is not None:
        return int(h) if not hasattr(h, "value") else int(h.value or 0)
    return id(stream)       # the simulator's streams have no handle: their identity keys scratch


def _words(header):
    if type(header) is tuple and len(header) == 8 and type(header[0]) is np.uint64:
        return header
    return tuple(np.uint64(int(w)) for w in header)


_NO_EXPECT = (0, 0, 0, 0, 0, 0, 0)
_ZERO = []


def _zero_status():
    """A device int32[2] of zeros: the status of decodes given none (one device per process)."""
    if not _ZERO:
        _ZERO.append(cuda.to_device(np.zeros(2, np.int32)))
    return _ZERO[0]


_NSM = []
_SIM_DUMMY = []


def _sim_no_src():
    """The trailing arguments of a plain (not reduce_requantize) general-path encode in the
    simulator: unused, but typed."""
    if not _SIM_DUMMY:
        _SIM_DUMMY.append((cuda.to_device(np.zeros(4, np.uint8)), cuda.to_device(np.zeros(1, np.uint32)),
                           cuda.to_device(np.zeros(1, np.float32)), cuda.to_device(np.zeros(2, np.int32)),
                           _NO_EXPECT, False, False, 0, 0, 0, cuda.to_device(np.zeros(1, np.float32)),
                           False))
    return _SIM_DUMMY[0]


def _sm_count():
    if not _NSM:
        _NSM.append(2 if SIMULATOR else int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
    return _NSM[0]


def _grid(n, per):
    return (n + per - 1) // per


def _persistent(raw, grid):
    """A warp decode's grid: at most the blocks resident on the GPU at once (the kernel strides)."""
    try:
        return min(grid, max(1, int(raw.kern.max_cooperative_grid_blocks(BLOCK))))
    except Exception:       # pragma: no cover - occupancy query unavailable
        return min(grid, 4 * _sm_count())


# a warp decode's multi-payload arguments for one plain payload: npay, pw, psoff, bpc, last_psoff
_ONE_PAYLOAD = (1, 0, 0, 1, 0)


def _encode_groups(bs, bits):
    """Buckets per block G for the fused general encode: G*bs*bits a multiple of 32 (blocks own whole
    code words), G*bs about ENC_ELEMS, G <= MAXG."""
    g0 = 32 // math.gcd(bs * bits, 32)
    g = max(1, _B.ENC_ELEMS // bs)
    g = -(-g // g0) * g0
    return min(g, _B.MAXG // g0 * g0)

def write_header_cuda(payload, header, stream=0):
    """Write the 64 header bytes (8 uint64 words, passed as a kernel argument: no host->device copy)."""
    _header_kernel()[1, 64, _nb_stream(stream)](
        payload, _words(header))


def check_header_cuda(payload, status, expect, stream=0):
    """Validate a device payload's header against ``expect`` (a ``wire.Expect``), on the device: one
    thread writes the error bits into ``status[0]`` and ORs them into ``status[1]`` (int32 device
    array). For raw payloads (fp16, none, fake), read by framework ops; kernel-decoded payloads pass
    ``expect`` to their decode instead."""
    exp = tuple(int(v) for v in expect[:7])
    _check_kernel()[1, 32, _nb_stream(stream)](
        payload, status, exp, bool(expect[7]))


def _nb_stream(stream):
    """A stream for a dispatcher launch (the simulator's, and the rare one-block kernels on
    hardware): Numba streams as they are, raw handles wrapped."""
    if not stream:
        return 0
    if type(stream) is int:
        s = _EXTERNAL.get(stream)
        if s is None:
            s = _EXTERNAL[stream] = cuda.external_stream(stream)
        return s
    return stream


_EXTERNAL = {}          # raw CUstream handle -> its Numba stream object
