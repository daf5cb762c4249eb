"""The CUDA launch layer and the prepared ops of QSGD and 1-bit.

The launch layer: kernels built once per specialisation (:data:`kernels`, keyed by tuples), the
driver's ``cuLaunchKernel`` with a parameter buffer per prepared launch (:class:`_Raw`), streams,
status words, grids, and the one-block header write and check (see :mod:`numba_kernels.cuda`).

The prepared ops, one class per kind (encode, decode, reduce_requantize, decode_sum, decode_chunks),
and the table :data:`PREPARE` that builds them: the kernel path, grid, layout and parameter buffer
are chosen once; a call writes the pointers and scalars that change and launches. A prepared op
belongs to its caller: it writes its parameter buffer and scratch on every call.

The simulator runs the same kernels with the same arguments, but it has no ``cuLaunchKernel`` and
no device pointers: each ``__call__`` therefore has one branch that hands the arguments to Numba's
dispatcher instead of writing them into the parameter buffer (``_sim*``).
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
from . import wire
from .reference import chunk_ranges
from ._cuda_device import (BLOCK, DEC_MEAN_ABS, DEC_QSGD, DEC_TWO_MEAN, L2, MAX, MEAN_ABS, PACK_DET,
                           PACK_ONEBIT, PACK_STOCH, SIG_BLOCK_DECODE, SIG_BLOCK_ENCODE, SIG_DECODE_MULTI,
                           SIG_REDUCE, SIG_WARP_DECODE, SIG_WARP_ENCODE, SIMULATOR, TWO_MEAN)


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


# ---- prepared launches --------------------------------------------------------------------------------

class _Encode:
    """A prepared encode: ``__call__(x, payload, header, key, stream, residual=None)``."""
    __slots__ = ("numel", "total", "codes_off", "scales_off", "nwords", "nscales", "bits", "bs", "red",
                 "pack", "path", "grid", "args", "spec", "_raw", "_rgrid", "_reduce", "_hdr", "src",
                 "_exp", "_cgrid", "_combine", "_parts")

    def __init__(self, numel, bits, bs, red, pack, lay, src=False):
        self.src = src              # reduce_requantize: the values are sums of payloads
        self._exp = None
        self.numel, self.bits, self.bs, self.red, self.pack = numel, bits, bs, red, pack
        self.total = lay.total
        self.codes_off, self.scales_off = lay.codes_offset, lay.scales_offset
        self.nwords = (lay.scales_offset - lay.codes_offset) // 4
        self.nscales = lay.nscales
        nb = lay.nbuckets
        self._raw = {}
        self._reduce = self._combine = None
        self._parts = {}
        self._hdr = None
        if _W.supported(bits, bs, numel, FUSE_MAX):
            self.path = "warp"
            ngroups = max(1, _grid(nb, BLOCK // 32))
            regk = _W.regk(bs)
            paired = pack == PACK_STOCH and regk >= 2 and bs % 64 == 0
            self.spec = (bits, red, pack, regk, paired)
            self.grid = ngroups
            # n, nb, bs, K, ngroups
            self.args = (numel, nb, bs, (bs + 31) // 32, ngroups)
        else:
            self.path = "block"
            self.spec = (bits, red, pack)
            if bs <= FUSE_MAX:
                g = _encode_groups(bs, bits)
                self.grid = max(1, _grid(nb, g))
                fused = True
            else:
                g = _B.PACK_WORDS // bits * bits       # blocks start on element boundaries
                self.grid = max(1, _grid(self.nwords, g))
                fused = False
                self._rgrid = _grid(nb * -(-bs // _B.SEGMENT), BLOCK // 32)     # a warp per segment
                self._cgrid = _grid(nb, BLOCK // 32)                            # a warp per bucket
            # n, nb, bs, inv_bs, G, fused
            self.args = (numel, nb, bs, 1.0 / bs, g, fused)

    def _dispatcher(self, resid):
        if self.path == "warp":
            if self.src:
                return _kernel("warp_reduce_requantize", _W.make_encode, self.spec + (resid, True))
            return _kernel("warp_encode", _W.make_encode, self.spec + (resid,))
        if self.src:
            return _kernel("block_reduce_requantize", _B.make_encode, self.spec + (resid, True))
        return _kernel("block_encode", _B.make_encode, self.spec + (resid,))

    def _reducer(self):
        if self.src:
            return _kernel("reduce_sum", _B.make_reduce, (self.red, self.bits, self.pack, True))
        return _kernel("reduce", _B.make_reduce, (self.red,))

    def _combiner(self):
        return _kernel("combine", _B.make_combine, (self.red,))

    def _scratch(self, stream):
        """The segments' sums of a long-bucket encode (3 float32 per segment), one array per stream,
        allocated once: work on one stream runs in order, so its calls may reuse it."""
        parts = self._parts.get(stream)
        if parts is None:
            parts = self._parts[stream] = cuda.device_array(3 * self._rgrid * (BLOCK // 32), np.float32)
        return parts

    def _src_sizes(self):
        n = self.numel
        return [self.total, self.nwords, self.nscales, 2, None, 0, 0, 0, self.total // 4,
                self.scales_off // 4, n, 0]

    def _prepare_raw(self, resid):
        sig = SIG_WARP_ENCODE if self.path == "warp" else SIG_BLOCK_ENCODE
        sizes = ([self.numel, self.total, self.nwords, self.nscales, None] + list(self.args)
                 + [0, self.numel] + self._src_sizes())
        raw = self._raw[resid] = _Raw(self._dispatcher(resid), sig, sizes)
        if self.path == "block" and not self.args[5] and self.numel and self._reduce is None:
            nparts = 3 * self._rgrid * (BLOCK // 32)
            self._reduce = _Raw(self._reducer(), SIG_REDUCE,
                                [self.numel, nparts, self.numel, self.bs, self.args[1]] + self._src_sizes())
            self._combine = _Raw(self._combiner(), SIG_REDUCE,
                                 [nparts, self.nscales, self.numel, self.bs, self.args[1]] + self._src_sizes())
        return raw

    def _launch_scales(self, x_ptr, scales_ptr, st):
        """A long-bucket encode's scales: the segments' sums, then the buckets'."""
        self._reduce.slots[1].value = self._combine.slots[0].value = _ptr(self._scratch(st))
        self._reduce.slots[0].value = x_ptr
        self._reduce.launch(self._rgrid, BLOCK, st)
        self._combine.slots[1].value = scales_ptr
        self._combine.launch(self._cgrid, BLOCK, st)

    def _sim_scales(self, x, scales, stream, extra):
        parts = self._scratch(stream)
        self._reducer()[self._rgrid, BLOCK, stream](x, parts, self.numel, self.bs, self.args[1], *extra)
        self._combiner()[self._cgrid, BLOCK, stream](parts, scales, self.numel, self.bs, self.args[1],
                                                     *extra)

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        resid = residual is not None
        if SIMULATOR:       # no cuLaunchKernel there: the same arguments through the dispatcher
            return self._sim(x, payload, header, key, stream, residual)
        raw = self._raw.get(resid)
        if raw is None:
            raw = self._prepare_raw(resid)
        px = _ptr(x)
        pp = _ptr(payload)
        s = raw.slots
        s[0].value = px
        s[1].value = pp
        s[2].value = pp + self.codes_off
        s[3].value = pp + self.scales_off
        hs = self._hdr                      # (a plan passes the same header words every step)
        if hs is None or hs[1] is not header or hs[0] is not raw:
            raw.set_tuple(4, header)
            self._hdr = (raw, header)
        nargs = len(self.args)
        s[5 + nargs].value = int(key)
        s[6 + nargs].value = _ptr(residual) if resid else px
        st = _stream(stream)
        if self._reduce is not None:
            self._launch_scales(px, pp + self.scales_off, st)
        raw.launch(self.grid, BLOCK, st)

    def _sim(self, x, payload, header, key, stream, residual):
        stream = _nb_stream(stream)
        x = x.reshape(-1) if x.ndim != 1 else x
        words = payload[self.codes_off:self.scales_off].view(np.uint32)
        scales = payload[self.scales_off:self.scales_off + 4 * self.nscales].view(np.float32)
        res = x if residual is None else (residual.reshape(-1) if residual.ndim != 1 else residual)
        extra = _sim_no_src()
        if self.path == "block" and not self.args[5] and self.numel:
            self._sim_scales(x, scales, stream, extra)
        self._dispatcher(residual is not None)[self.grid, BLOCK, stream](
            x, payload, words, scales, _words(header), *self.args, np.uint64(int(key)), res, *extra)


class _Decode:
    """A prepared decode: ``__call__(payload, out, stream, status, expect)``."""
    __slots__ = ("numel", "total", "codes_off", "scales_off", "nwords", "nscales", "path", "spec",
                 "args", "grid", "_raw", "_exp")

    def __init__(self, numel, bits, bs, kind, accumulate, lay):
        self.numel = numel
        self.total = lay.total
        self.codes_off, self.scales_off = lay.codes_offset, lay.scales_offset
        self.nwords = (lay.scales_offset - lay.codes_offset) // 4
        self.nscales = lay.nscales
        nb = lay.nbuckets
        self._raw = None
        self._exp = None
        if _W.supported(bits, bs, numel, FUSE_MAX):
            self.path = "warp"
            self.spec = (bits, kind, _W.dec_steps(bs))
            ngroups = _grid(nb, BLOCK // 32)
            self.grid = ngroups          # capped at the resident blocks once compiled (persistent grid)
            # n, nb, bs, K, ngroups, accumulate
            self.args = (numel, nb, bs, (bs + 31) // 32, ngroups, bool(accumulate))
        else:
            self.path = "block"
            self.spec = (bits, kind)
            nchunks = _grid(numel, _B.DEC_CHUNK)
            self.grid = min(nchunks, 8 * _sm_count())
            # n, bs, inv_bs, accumulate, nchunks
            self.args = (numel, bs, 1.0 / bs, bool(accumulate), nchunks)

    def _dispatcher(self):
        if self.path == "warp":
            return _kernel("warp_decode", _W.make_decode, self.spec)
        return _kernel("block_decode", _B.make_decode, self.spec)

    def _prepare_raw(self):
        sig = SIG_WARP_DECODE if self.path == "warp" else SIG_BLOCK_DECODE
        sizes = [self.total, self.nwords, self.nscales, self.numel, 2, None, 0, 0] + list(self.args)
        if self.path == "warp":
            sizes += [1] + list(_ONE_PAYLOAD)
        raw = self._raw = _Raw(self._dispatcher(), sig, sizes)
        if self.path == "warp":
            self.grid = _persistent(raw, self.grid)
        return raw

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        if self.numel == 0:
            if expect is not None and status is not None:
                check_header_cuda(payload, status, expect, stream)
            return
        if SIMULATOR:       # no cuLaunchKernel there: the same arguments through the dispatcher
            return self._sim(payload, out, stream, status, expect)
        raw = self._raw
        if raw is None:
            raw = self._prepare_raw()
        pp = _ptr(payload)
        s = raw.slots
        s[0].value = pp
        s[1].value = pp + self.codes_off
        s[2].value = pp + self.scales_off
        s[3].value = _ptr(out)
        s[4].value = _ptr(_zero_status() if status is None else status)
        if expect is not self._exp:
            if expect is None:
                raw.set_tuple(5, _NO_EXPECT)
                s[6].value = False
                s[7].value = False
            else:
                raw.set_tuple(5, expect[:7])
                s[6].value = True
                s[7].value = bool(expect[7])
            self._exp = expect
        raw.launch(self.grid, BLOCK, _stream(stream))

    def _sim(self, payload, out, stream, status, expect):
        stream = _nb_stream(stream)
        words = payload[self.codes_off:self.scales_off].view(np.uint32)
        scales = payload[self.scales_off:self.scales_off + 4 * self.nscales].view(np.float32)
        out = out.reshape(-1) if out.ndim != 1 else out
        if expect is None:
            exp, check, check_name = _NO_EXPECT, False, False
        else:
            exp, check, check_name = tuple(int(v) for v in expect[:7]), True, bool(expect[7])
        extra = (_sim_no_src()[1],) + _ONE_PAYLOAD if self.path == "warp" else ()
        self._dispatcher()[self.grid, BLOCK, stream](
            payload, words, scales, out, _zero_status() if status is None else status, exp, check,
            check_name, *self.args, *extra)


# ---- fused operations: several payloads in one launch (see numba_kernels.reference) -------------------

def _expect_args(expect):
    if expect is None:
        return _NO_EXPECT, False, False
    return tuple(int(v) for v in expect[:7]), True, bool(expect[7])


class _ReduceRequantize(_Encode):
    """A prepared reduce_requantize: ``(payloads, n, residual, out_payload, header, key, stream,
    status, expect)``, one launch of the general path's encode (three above FUSE_MAX: the scales'
    reduce and combine, then the pack) whose values are the payloads' sums plus ``residual``,
    computed where the encode reads them (registers; nothing float32 goes through global memory). A
    bad payload among the n makes the sum NaN (the reference's encode of NaN); its error bits go to
    ``status``."""
    __slots__ = ()

    def __call__(self, payloads, n, residual, out_payload, header, key=0, stream=None, status=None,
                 expect=None):
        resid = residual is not None
        if SIMULATOR:       # no cuLaunchKernel there: the same arguments through the dispatcher
            return self._sim_src(payloads, n, residual, out_payload, header, key, stream, status, expect)
        raw = self._raw.get(resid)
        if raw is None:
            raw = self._prepare_raw(resid)
        pp = _ptr(out_payload)
        pin = _ptr(payloads)
        pr = _ptr(residual) if resid else 0
        pst = _ptr(_zero_status() if status is None else status)
        exp, check, check_name = _expect_args(expect)
        nargs = len(self.args)
        s = raw.slots
        s[0].value = pp                       # (x: unused)
        s[1].value = pp
        s[2].value = pp + self.codes_off
        s[3].value = pp + self.scales_off
        hs = self._hdr
        if hs is None or hs[1] is not header or hs[0] is not raw:
            raw.set_tuple(4, header)
            self._hdr = (raw, header)
        s[5 + nargs].value = int(key)
        s[6 + nargs].value = pr
        st = _stream(stream)
        new_exp = self._exp is None or self._exp[0] is not raw or self._exp[1] is not expect
        self._exp = (raw, expect)
        for r, i0 in ((self._reduce, 5), (raw, 7 + nargs)):
            if r is None:
                continue
            t = r.slots
            r.set_payloads(i0, pin, n, self.total)
            t[i0 + 3].value = pst
            if new_exp:
                r.set_tuple(i0 + 4, exp)
            t[i0 + 5].value = check
            t[i0 + 6].value = check_name
            t[i0 + 7].value = int(n)
            t[i0 + 10].value = pr
            t[i0 + 11].value = resid
        if self._reduce is not None:
            self._launch_scales(pp, pp + self.scales_off, st)
        raw.launch(self.grid, BLOCK, st)

    def _sim_src(self, payloads, n, residual, out_payload, header, key, stream, status, expect):
        stream = _nb_stream(stream)
        words = out_payload[self.codes_off:self.scales_off].view(np.uint32)
        scales = out_payload[self.scales_off:self.scales_off + 4 * self.nscales].view(np.float32)
        rin = residual if residual is not None else _sim_no_src()[2]
        exp, check, check_name = _expect_args(expect)
        src = (payloads, payloads.view(np.uint32), payloads.view(np.float32),
               _zero_status() if status is None else status, exp, check, check_name, int(n),
               self.total // 4, self.scales_off // 4, rin, residual is not None)
        if self.path == "block" and not self.args[5] and self.numel:
            self._sim_scales(rin, scales, stream, src)
        self._dispatcher(residual is not None)[self.grid, BLOCK, stream](
            rin, out_payload, words, scales, _words(header), *self.args, np.uint64(int(key)), rin, *src)


class _DecodeMulti:
    """The base of a prepared decode_sum ``(payloads, n, out, stream, status, expect)`` and
    decode_chunks ``(gathered, out, stream, status, name_hashes, expect)``: one launch of the warp decode in a
    multi-payload mode where the warp kernels apply, else of ``block_decode_multi``."""
    __slots__ = ("numel", "total", "chunks", "spec", "grid", "args", "method", "bits", "mode", "bs0",
                 "chunk", "offsets", "path", "_nh", "_np", "_raw", "_exp")

    def __init__(self, numel, bits, bucket_size, kind, two_mean, chunk=None):
        self.numel, self.bits, self.bs0 = numel, bits, bucket_size
        qsgd = two_mean is None
        self.method = wire.METHODS["qsgd" if qsgd else "onebit"]
        self.mode = 0 if qsgd else wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
        bs = bucket_size or max(numel, 1)
        self.chunks = chunk is not None
        if self.chunks:
            ranges = chunk_ranges(numel, bucket_size, chunk)
            if len(ranges) > MAXCH:
                raise ValueError(f"{len(ranges)} chunks: at most {MAXCH} in one decode_chunks")
            if not bucket_size:
                chunk = bs
            full = wire.layout(self.method, min(chunk, numel), bits, bucket_size, self.mode)
            lm = ranges[-1][1] - ranges[-1][0] if ranges else 0
            last = wire.layout(self.method, lm, bits, bucket_size, self.mode)
            self.offsets = [j * full.total for j in range(len(ranges))] + [
                (len(ranges) - 1) * full.total + last.total if ranges else 0]
            self.total = self.offsets[-1]
            tail = (chunk, lm, last.scales_offset // 4)
        else:
            full = wire.layout(self.method, numel, bits, bucket_size, self.mode)
            self.total = full.total
            tail = (max(numel, 1), numel, full.scales_offset // 4)
        self.chunk = chunk
        multi = _B.MULTI_CHUNKS if self.chunks else _B.MULTI_SUM
        pw, psoff = full.total // 4, full.scales_offset // 4
        # the kernel's arguments after check_name; None: name_hashes (at self._nh), npay at self._np
        if _W.supported(bits, bs, numel, FUSE_MAX):
            self.path = "warp"
            self.spec = (bits, kind, _W.dec_steps(bs), multi)
            nb = _grid(numel, bs)
            self.grid = max(1, _grid(nb, BLOCK // 32))     # capped once compiled (persistent grid)
            # n, nb, bs, K, ngroups, accumulate, name_hashes, npay, words per payload, scales offset
            # (words), buckets per chunk, the last chunk's scales offset (words)
            self.args = (numel, nb, bs, (bs + 31) // 32, self.grid, False, None, 1, pw, psoff,
                         max(1, tail[0] // bs), tail[2])
            self._nh, self._np = 6, 7
        else:
            self.path = "block"
            self.spec = (bits, kind, multi)
            nchunks = _grid(numel, _B.DEC_CHUNK)
            self.grid = max(1, min(nchunks, 8 * _sm_count()))
            # name_hashes, n, bs, inv_bs, nchunks, npay, words per payload, scales offset (words),
            # chunk, last numel, last chunk's scales offset (words)
            self.args = (None, numel, bs, 1.0 / bs, nchunks, 1, pw, psoff) + tail
            self._nh, self._np = 0, 5
        self._raw = None
        self._exp = None

    def _dispatcher(self):
        if self.path == "warp":
            return _kernel("warp_decode_multi", _W.make_decode, self.spec)
        return _kernel("block_decode_multi", _B.make_decode_multi, self.spec)

    def _checks(self, expect, name_hashes):
        if name_hashes is not None and expect is None:
            if self.method == wire.METHODS["qsgd"]:
                raise ValueError("checking QSGD chunks needs expect (it gives the mode and norm)")
            expect = wire.Expect(self.method, 1, self.mode, 0, self.bs0, 0)
        exp, check, _ = _expect_args(expect)
        if self.chunks:
            return exp, check, name_hashes is not None
        return exp, check, bool(expect[7]) if check else False

    def _launch(self, payloads, n, out, stream, status, expect, name_hashes):
        exp, check, check_name = self._checks(expect, name_hashes)
        if self.numel == 0 and not (check and status is not None):
            return
        if SIMULATOR:       # no cuLaunchKernel there: the same arguments through the dispatcher
            args = list(self.args)
            args[self._nh] = name_hashes if name_hashes is not None else _sim_no_src()[1]
            args[self._np] = int(n)
            out = out.reshape(-1) if out.ndim != 1 else out
            return self._dispatcher()[self.grid, BLOCK, _nb_stream(stream)](
                payloads, payloads.view(np.uint32), payloads.view(np.float32), out,
                _zero_status() if status is None else status, exp, check, check_name, *args)
        raw = self._raw
        if raw is None:
            sig = SIG_WARP_DECODE if self.path == "warp" else SIG_DECODE_MULTI
            raw = self._raw = _Raw(self._dispatcher(), sig,
                                   [self.total, self.total // 4, self.total // 4, self.numel, 2, None,
                                    0, 0] + [1 if a is None else a for a in self.args])
            if self.path == "warp":
                self.grid = _persistent(raw, self.grid)
        s = raw.slots
        raw.set_payloads(0, _ptr(payloads), n, self.total)
        s[3].value = _ptr(out)
        s[4].value = _ptr(_zero_status() if status is None else status)
        if exp != self._exp:        # what the kernel checks (name hashes alone make one up)
            raw.set_tuple(5, exp)
            self._exp = exp
        s[6].value = check
        s[7].value = check_name
        s[8 + self._nh].value = _ptr(name_hashes) if name_hashes is not None else 0
        s[8 + self._np].value = int(n)
        raw.launch(self.grid, BLOCK, _stream(stream))



class _DecodeSum(_DecodeMulti):
    __slots__ = ()

    def __call__(self, payloads, n, out, stream=None, status=None, expect=None):
        self._launch(payloads, n, out, stream, status, expect, None)


class _DecodeChunks(_DecodeMulti):
    __slots__ = ()

    def __call__(self, gathered, out, stream=None, status=None, name_hashes=None, expect=None):
        self._launch(gathered, 1, out, stream, status, expect, name_hashes)


def _kinds(two_mean):
    if two_mean is None:
        return DEC_QSGD
    return DEC_TWO_MEAN if two_mean else DEC_MEAN_ABS


def _qsgd_encode(numel, bits, bucket_size, stochastic, norm_l2, cls=_Encode):
    lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
    return cls(numel, bits, bucket_size, L2 if norm_l2 else MAX, PACK_STOCH if stochastic else PACK_DET, lay,
               src=cls is _ReduceRequantize)


def _onebit_encode(numel, bucket_size, two_mean, cls=_Encode):
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode)
    return cls(numel, 1, bucket_size or max(numel, 1), TWO_MEAN if two_mean else MEAN_ABS, PACK_ONEBIT, lay,
               src=cls is _ReduceRequantize)


def _qsgd_decode(numel, bits, bucket_size, accumulate):
    return _Decode(numel, bits, bucket_size, DEC_QSGD, accumulate,
                   wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size))


def _onebit_decode(numel, bucket_size, two_mean, accumulate):
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    return _Decode(numel, 1, bucket_size or max(numel, 1), _kinds(bool(two_mean)), accumulate,
                   wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, mode))


# (method, kind) -> the prepared op's factory, with the same keyword parameters as numba_kernels.cpu's
# (numba_kernels.cuda adds SortQuant's and KMeans')
PREPARE = {
    ("qsgd", "encode"): _qsgd_encode,
    ("qsgd", "decode"): _qsgd_decode,
    ("qsgd", "decode_sum"): lambda numel, bits, bucket_size: _DecodeSum(numel, bits, bucket_size, DEC_QSGD,
                                                                        None),
    ("qsgd", "reduce_requantize"): lambda numel, bits, bucket_size, stochastic, norm_l2: _qsgd_encode(
        numel, bits, bucket_size, stochastic, norm_l2, _ReduceRequantize),
    ("qsgd", "decode_chunks"): lambda numel, bits, bucket_size, chunk: _DecodeChunks(
        numel, bits, bucket_size, DEC_QSGD, None, chunk),
    ("onebit", "encode"): _onebit_encode,
    ("onebit", "decode"): _onebit_decode,
    ("onebit", "decode_sum"): lambda numel, bucket_size, two_mean: _DecodeSum(
        numel, 1, bucket_size, _kinds(bool(two_mean)), bool(two_mean)),
    ("onebit", "reduce_requantize"): lambda numel, bucket_size, two_mean: _onebit_encode(
        numel, bucket_size, two_mean, _ReduceRequantize),
    ("onebit", "decode_chunks"): lambda numel, bucket_size, two_mean, chunk: _DecodeChunks(
        numel, 1, bucket_size, _kinds(bool(two_mean)), bool(two_mean), chunk),
}
