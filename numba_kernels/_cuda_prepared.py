"""The CUDA launch layer (docs/ARCHITECTURE.md) and the prepared ops of QSGD and 1-bit (:data:`PREPARE`).

A prepared op chooses its kernel path, grid, layout and parameter buffer once; a call writes the
pointers and scalars that change and launches. In the simulator (the one ``if SIMULATOR`` below) a
pointer is an array and a byte offset, and a launch hands the buffer's values to Numba's dispatcher.
"""
import ctypes
import math
import threading
import warnings
from functools import lru_cache, partial

import numpy as np
from numba import cuda, types as nbt

from . import _cuda_block as _B
from . import _cuda_warp as _W
from . import wire
from .reference import chunk_ranges
from ._cuda_block import FUSE_MAX, MAXCH, MULTI_CHUNKS, MULTI_SUM, PLAIN
from ._cuda_device import (BLOCK, DEC_MEAN_ABS, DEC_QSGD, DEC_TWO_MEAN, L2, MAX, MEAN_ABS, PACK_DET,
                           PACK_ONEBIT, PACK_STOCH, SIG_BLOCK_DECODE, SIG_BLOCK_ENCODE, SIG_DECODE_MULTI,
                           SIG_REDUCE, SIG_WARP_DECODE, SIG_WARP_ENCODE, SIMULATOR, TWO_MEAN)

# the header check and write are one-block kernels by design: silence Numba's occupancy hint alone
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


def kernel_path(bits, bucket_size, numel):
    """'warp' or 'block': the kernel path a configuration takes (bucket_size 0: one bucket)."""
    bs = int(bucket_size) or max(int(numel), 1)
    return "warp" if _W.supported(int(bits), bs, int(numel), FUSE_MAX) else "block"


# ---- direct launches ----------------------------------------------------------------------------------

_SUCCESS, _INVALID_CONTEXT = 0, 201     # CUDA_SUCCESS, CUDA_ERROR_INVALID_CONTEXT


def _driver_launch():
    """The driver's ``cuLaunchKernel`` through ctypes, its argument types declared once (cheap per call)."""
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


# the kernels' scalar parameter types: their C types, and their Python types in the simulator
_CTYPE = {nbt.boolean: ctypes.c_bool, nbt.float64: ctypes.c_double, nbt.int64: ctypes.c_int64,
          nbt.uint64: ctypes.c_uint64}
_PYTYPE = {nbt.boolean: bool, nbt.float64: float, nbt.int64: int, nbt.uint64: np.uint64}
_UNSET = object()


class _Raw:
    """One compiled kernel and its parameter buffer, built once.

    Numba passes an array argument as 7 parameters (meminfo, parent, nitems, itemsize, data, shape,
    strides: ``_Kernel._prepare_args``), a tuple as its elements, a scalar as its C type; the buffer
    holds one ctypes object per parameter and ``cuLaunchKernel`` gets the array of their addresses.
    ``sizes[i]``: the element count of array argument ``i`` (a kernel clamps its slices of an array
    to it), the initial value of a scalar."""
    _POINTER = ctypes.c_uint64

    def __init__(self, disp, sig, sizes):
        self.disp, self.sig = disp, sig
        self.slots = []             # per argument: the ctypes objects to update
        self.dims = []              # per argument: an array's (nitems, shape) objects, else None
        self._tuples = {}           # tuple argument -> the values last written
        self._expect = _UNSET
        objs = self._objs = []
        for ty, size in zip(sig, sizes):
            dims = None
            if isinstance(ty, nbt.Array):
                item, slot = ctypes.c_int64(ty.dtype.bitwidth // 8), self._POINTER(0)
                dims = (ctypes.c_int64(size), ctypes.c_int64(size))
                objs += [ctypes.c_int64(0), ctypes.c_int64(0), dims[0], item, slot, dims[1], item]
            elif isinstance(ty, nbt.BaseTuple):
                slot = [_CTYPE[t](0) for t in ty]
                objs += slot
            else:
                slot = _CTYPE[ty](size or 0)
                objs.append(slot)
            self.slots.append(slot)
            self.dims.append(dims)
        self._bind()

    def _bind(self):
        self.kern = self.disp.compile(self.sig)
        self.handle = int(self.kern._codelibrary.get_cufunc().handle)
        self._params = (ctypes.c_void_p * len(self._objs))(*[ctypes.addressof(o) for o in self._objs])
        self.addr = ctypes.addressof(self._params)

    def set_payloads(self, i, pointer, n, total):
        """Arguments ``i .. i+2``: ``n`` payloads of ``total`` bytes back to back at ``pointer``, as
        bytes, 32-bit words and float32."""
        for k, size in ((i, n * total), (i + 1, n * total // 4), (i + 2, n * total // 4)):
            self.slots[k].value = pointer
            for o in self.dims[k]:
                o.value = size

    def set_tuple(self, i, values):
        if self._tuples.get(i) is not values:      # (a plan passes the same header words every step)
            self._tuples[i] = values
            for o, v in zip(self.slots[i], values):
                o.value = int(v)

    def set_check(self, i, status, expect, check_name=None):
        """Arguments ``i .. i+3``: the status word, the expected header fields, check and check_name
        (from ``expect`` unless given)."""
        s = self.slots
        s[i].value = _ptr(_zero_status(expect is not None) if status is None else status)
        if expect is not self._expect:
            self._expect = expect
            self.set_tuple(i + 1, _NO_EXPECT if expect is None else tuple(expect[:7]))
            s[i + 2].value = expect is not None
            s[i + 3].value = expect is not None and bool(expect[7])
        if check_name is not None:
            s[i + 3].value = check_name

    def launch(self, grid, block, stream):
        err = _cu_launch(self.handle, grid, 1, 1, block, 1, 1, 0, stream or None, self.addr, None)
        if err == _INVALID_CONTEXT:             # a thread that never used CUDA: make Numba's current
            cuda.current_context()
            err = _cu_launch(self.handle, grid, 1, 1, block, 1, 1, 0, stream or None, self.addr, None)
        if err != _SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {err}")


def _ptr(a):
    """Device pointer of a Numba device array, a ``__cuda_array_interface__`` object or an int."""
    if type(a) is int:
        return a
    return a.__cuda_array_interface__["data"][0]


if SIMULATOR:
    _cu_launch = None

    class _Ptr:
        """The simulator's device pointer: an array (flat) and a byte offset into it."""
        __slots__ = ("a", "off")

        def __init__(self, a, off=0):
            self.a, self.off = a, off

        def __add__(self, k):
            return _Ptr(self.a, self.off + k)

    def _ptr(a):        # noqa: F811 - the simulator's arrays have no pointers
        return _Ptr(a.reshape(-1) if a.ndim != 1 else a)

    @lru_cache(None)
    def _unused(dt):
        """An array for the arguments a kernel does not read (pointer 0)."""
        return cuda.to_device(np.zeros(1, dt))

    class _Raw(_Raw):   # noqa: F811 - the parameter buffer's values through the dispatcher
        _POINTER = ctypes.py_object

        def _bind(self):
            self.kern = None

        def launch(self, grid, block, stream):
            args = []
            for ty, slot, dims in zip(self.sig, self.slots, self.dims):
                if isinstance(ty, nbt.Array):
                    dt, p = np.dtype(str(ty.dtype)), slot.value
                    args.append(_unused(dt) if p == 0 else
                                p.a.view(np.uint8)[p.off:p.off + dims[0].value * dt.itemsize].view(dt))
                elif isinstance(ty, nbt.BaseTuple):
                    args.append(tuple(_PYTYPE[t](o.value) for t, o in zip(ty, slot)))
                else:
                    args.append(_PYTYPE[ty](slot.value))
            self.disp[grid, block](*args)
else:
    _cu_launch = _driver_launch()


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


def _nb_stream(stream):
    """A stream for a dispatcher launch: Numba streams as they are, raw handles wrapped (once each)."""
    if not stream:
        return 0
    if type(stream) is int:
        s = _EXTERNAL.get(stream)
        if s is None:
            s = _EXTERNAL[stream] = cuda.external_stream(stream)
        return s
    return stream


_EXTERNAL = {}          # raw CUstream handle -> its Numba stream object
_NO_EXPECT = (0, 0, 0, 0, 0, 0, 0)


@lru_cache(None)
def _zero_status(sink=False):
    """A device int32[2] of zeros for ops given no status (one device per process): read by those
    given no ``expect`` (so it stays zero), or with ``sink`` written by those given one."""
    return cuda.to_device(np.zeros(2, np.int32))


@lru_cache(None)
def _sm_count():
    return 2 if SIMULATOR else int(cuda.get_current_device().MULTIPROCESSOR_COUNT)


def _grid(n, per):
    return (n + per - 1) // per


def write_header_cuda(payload, header, stream=0):
    """Write the 64 header bytes (8 uint64 words, passed as a kernel argument: no host->device copy)."""
    kernels.setdefault(("header",), _B.k_header)
    _B.k_header[1, 64, _nb_stream(stream)](payload, tuple(np.uint64(int(w)) for w in header))


def check_header_cuda(payload, status, expect, stream=0):
    """Check a device payload's header against ``expect`` (a ``wire.Expect``) into ``status`` (as ``k_check``),
    for raw payloads (fp16, none, fake); kernel-decoded payloads pass ``expect`` to their decode instead."""
    kernels.setdefault(("check",), _B.k_check)
    _B.k_check[1, 32, _nb_stream(stream)](payload, status, tuple(int(v) for v in expect[:7]), bool(expect[7]))


# ---- prepared launches --------------------------------------------------------------------------------

class _Op:
    """What every prepared op of one payload layout holds: the layout and the kernel path."""

    def __init__(self, numel, bits, bs, lay):
        self.numel, self.total = numel, lay.total
        self.codes_off, self.scales_off = lay.codes_offset, lay.scales_offset
        self.nwords = (lay.scales_offset - lay.codes_offset) // 4
        self.nscales = lay.nscales
        self.warp = _W.supported(bits, bs, numel, FUSE_MAX)
        self._raw = None

    def _prepared(self):
        """The decode's parameter buffer, built on the first call; a warp decode's grid made persistent:
        at most the blocks resident on the GPU at once (the kernel strides)."""
        raw = self._raw
        if raw is None:
            raw = self._raw = _Raw(_kernel(*self.kernel), self.sig, self.sizes)
            if self.warp:
                try:
                    self.grid = min(self.grid, max(1, int(raw.kern.max_cooperative_grid_blocks(BLOCK))))
                except Exception:       # occupancy query unavailable (the simulator)
                    self.grid = min(self.grid, 4 * _sm_count())
        return raw


class _Encode(_Op):
    """A prepared encode: ``(x, payload, header, key, stream, residual=None)``; the general path's
    buckets above FUSE_MAX take two launches for the scales (segment sums, then bucket sums) before
    the pack-only encode."""

    def __init__(self, numel, bits, bs, red, pack, lay):
        super().__init__(numel, bits, bs, lay)
        self.bits, self.bs, self.red, self.pack = bits, bs, red, pack
        nb = lay.nbuckets
        self._raw = {}              # residual given -> its parameter buffer
        self._reduce = self._combine = None
        self._parts = {}
        if self.warp:
            regk = _W.regk(bs)
            self.spec = (bits, red, pack, regk, pack == PACK_STOCH and regk >= 2 and bs % 64 == 0)
            self.grid = max(1, _grid(nb, BLOCK // 32))
            self.args = (numel, nb, bs, (bs + 31) // 32, self.grid)         # n, nb, bs, K, ngroups
        else:
            self.spec = (bits, red, pack)
            fused = bs <= FUSE_MAX
            if fused:       # G buckets per block: G*bs*bits a multiple of 32, G*bs about ENC_ELEMS, G <= MAXG
                g0 = 32 // math.gcd(bs * bits, 32)
                g = min(-(-max(1, _B.ENC_ELEMS // bs) // g0) * g0, _B.MAXG // g0 * g0)
                self.grid = max(1, _grid(nb, g))
            else:
                g = _B.PACK_WORDS // bits * bits       # blocks start on element boundaries
                self.grid = max(1, _grid(self.nwords, g))
                self._rgrid = _grid(nb * -(-bs // _B.SEGMENT), BLOCK // 32)     # a warp per segment
                self._cgrid = _grid(nb, BLOCK // 32)                            # a warp per bucket
            self.args = (numel, nb, bs, 1.0 / bs, g, fused)                     # n, nb, bs, inv_bs, G, fused
        self._key = 5 + len(self.args)      # the argument key, then residual, then the payloads' (_SRC)

    src = False         # reduce_requantize: the values are sums of payloads

    def _prepare_raw(self, resid):
        what = "reduce_requantize" if self.src else "encode"
        spec = self.spec + (resid,) + ((True,) if self.src else ())
        src = [self.total, self.nwords, self.nscales, 2, None, 0, 0, 0, self.total // 4,
               self.scales_off // 4, self.numel, 0]
        sizes = [self.numel, self.total, self.nwords, self.nscales, None, *self.args, 0, self.numel, *src]
        path, make, sig = ("warp_", _W.make_encode, SIG_WARP_ENCODE) if self.warp else (
            "block_", _B.make_encode, SIG_BLOCK_ENCODE)
        raw = _Raw(_kernel(path + what, make, spec), sig, sizes)
        if not self.warp and not self.args[5] and self.numel and self._reduce is None:
            nb, parts = self.args[1], 3 * self._rgrid * (BLOCK // 32)
            red = (self.red, self.bits, self.pack, True) if self.src else (self.red,)
            self._reduce = _Raw(_kernel("reduce_sum" if self.src else "reduce", _B.make_reduce, red),
                                SIG_REDUCE, [self.numel, parts, self.numel, self.bs, nb] + src)
            self._combine = _Raw(_kernel("combine", _B.make_combine, (self.red,)), SIG_REDUCE,
                                 [parts, self.nscales, self.numel, self.bs, nb] + src)
        self._raw[resid] = raw
        return raw

    def _launch(self, raw, x_ptr, scales_ptr, stream):
        """The scales' two launches where the bucket needs them, then the encode."""
        if self._reduce is not None:
            parts = self._parts.get(stream)     # the segments' sums, one array per stream
            if parts is None:
                parts = self._parts[stream] = cuda.device_array(3 * self._rgrid * (BLOCK // 32), np.float32)
            self._reduce.slots[1].value = self._combine.slots[0].value = _ptr(parts)
            self._reduce.slots[0].value = x_ptr
            self._reduce.launch(self._rgrid, BLOCK, stream)
            self._combine.slots[1].value = scales_ptr
            self._combine.launch(self._cgrid, BLOCK, stream)
        raw.launch(self.grid, BLOCK, stream)

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        raw = self._raw.get(residual is not None) or self._prepare_raw(residual is not None)
        s = raw.slots                       # (set_tuple inlined: the tiny call's cost)
        px = s[0].value = _ptr(x)
        pp = s[1].value = _ptr(payload)
        s[2].value = pp + self.codes_off
        ps = s[3].value = pp + self.scales_off
        if raw._tuples.get(4) is not header:
            raw.set_tuple(4, header)
        s[self._key].value = int(key)
        s[self._key + 1].value = px if residual is None else _ptr(residual)
        if self._reduce is None:
            raw.launch(self.grid, BLOCK, _stream(stream))
        else:
            self._launch(raw, px, ps, _stream(stream))

    def bind(self, h, words):
        """The per-step call of ``Codec.bind_encode`` on ``x``'s stream; ``h``: the adapter's converters
        ``(input, payload, out, stream, status)`` (so are the other ops' ``bind``)."""
        f32, pay, to_out, stream = h[:4]
        return lambda x, payload, key, residual=None: self(f32(x)[1], pay(payload), words, key, stream(x),
                                                          None if residual is None else to_out(residual)[0])


class _ReduceRequantize(_Encode):
    """A prepared reduce_requantize: ``(payloads, n, residual, out_payload, header, key, stream,
    status, expect)``: the encode whose values are the n payloads' sums plus ``residual``, computed
    where the encode reads them (nothing float32 goes through global memory). A bad payload among the
    n makes the sum NaN (the reference's encode of NaN); its error bits go to ``status``."""
    src = True

    def __call__(self, payloads, n, residual, out_payload, header, key=0, stream=None, status=None,
                 expect=None):
        resid = residual is not None
        raw = self._raw.get(resid) or self._prepare_raw(resid)
        s = raw.slots
        pp = s[1].value = _ptr(out_payload)
        s[2].value = pp + self.codes_off
        s[3].value = pp + self.scales_off
        raw.set_tuple(4, header)
        pin = _ptr(payloads)
        pr = _ptr(residual) if resid else 0
        s[self._key].value = int(key)
        s[self._key + 1].value = pr
        for r, i in ((self._reduce, 5), (raw, self._key + 2)):     # the payloads' arguments (_SRC)
            if r is not None:
                r.set_payloads(i, pin, n, self.total)
                r.set_check(i + 3, status, expect)
                r.slots[i + 7].value = int(n)
                r.slots[i + 10].value = pr
                r.slots[i + 11].value = resid
        self._launch(raw, 0, pp + self.scales_off, _stream(stream))

    def bind(self, h, words, expect):
        _, pay, to_out, stream, status = h
        return lambda payloads, n, residual, out_payload, key: self(
            pay(payloads), n, None if residual is None else to_out(residual)[0], pay(out_payload), words, key,
            stream(out_payload), status, expect)


class _Decode(_Op):
    """A prepared decode ``(payload, out, stream, status, expect)`` of QSGD (``two_mean`` None) or
    1-bit; its subclasses, decode_sum and decode_chunks, are one launch of the same kernel (warp or
    general path) in a multi-payload ``mode``."""
    mode = PLAIN

    def __init__(self, numel, bits, bucket_size, two_mean, accumulate=False, chunk=None):
        qsgd = two_mean is None
        kind = DEC_QSGD if qsgd else DEC_TWO_MEAN if two_mean else DEC_MEAN_ABS
        method = wire.METHODS["qsgd" if qsgd else "onebit"]
        lmode = 0 if qsgd else wire.onebit_mode(two_mean)
        # decode_chunks given name hashes and no expect checks them alone (1-bit: nothing else to know)
        self._names_only = None if qsgd else wire.Expect(method, 1, lmode, 0, bucket_size, 0)
        bs = bucket_size or max(numel, 1)
        plain, nch = self.mode == PLAIN, 1
        if self.mode == MULTI_CHUNKS:
            ranges = chunk_ranges(numel, bucket_size, chunk)
            nch = max(1, len(ranges))
            if len(ranges) > MAXCH:
                raise ValueError(f"{len(ranges)} chunks: at most {MAXCH} in one decode_chunks")
            if not bucket_size:
                chunk = bs
            full = wire.layout(method, min(chunk, numel), bits, bucket_size, lmode)
            lm = ranges[-1][1] - ranges[-1][0] if ranges else 0
            last = wire.layout(method, lm, bits, bucket_size, lmode)
            total = (len(ranges) - 1) * full.total + last.total if ranges else 0
            tail = (chunk, lm, last.scales_offset // 4)
        else:
            full = wire.layout(method, numel, bits, bucket_size, lmode)
            total = full.total
            tail = (max(numel, 1), numel, full.scales_offset // 4)
        super().__init__(numel, bits, bs, full)
        self.total = total
        # one payload: its code words and scales; several: the whole buffer, payloads of pw words
        pw, psoff = (0, 0) if plain else (full.total // 4, full.scales_offset // 4)
        self.sizes = [total, self.nwords if plain else total // 4, self.nscales if plain else total // 4,
                      numel, 2, None, 0, 0]
        spec = (bits, kind) if plain else (bits, kind, self.mode)
        nb = _grid(numel, bs)
        # the arguments after check_name, name_hashes (at _nh, sized for the chunks) and npay (_np) among them
        if self.warp:
            name = "warp_decode" if plain else "warp_decode_multi"
            self.kernel = (name, _W.make_decode, spec[:2] + (_W.dec_steps(bs),) + spec[2:])
            self.sig = SIG_WARP_DECODE
            self.grid = max(1, _grid(nb, BLOCK // 32))     # capped once compiled (persistent grid)
            # n, nb, bs, K, ngroups, accumulate, name_hashes, npay, pw, psoff, buckets per chunk, the
            # last chunk's scales offset (words)
            self.sizes += [numel, nb, bs, (bs + 31) // 32, self.grid, bool(accumulate), nch, 1, pw, psoff,
                           max(1, tail[0] // bs), tail[2]]
            self._nh, self._np = 14, 15
        else:
            nchunks = _grid(numel, _B.DEC_CHUNK)
            self.grid = max(1, min(nchunks, 8 * _sm_count()))
            if plain:       # n, bs, inv_bs, accumulate, nchunks
                self.kernel, self.sig = ("block_decode", _B.make_decode, spec), SIG_BLOCK_DECODE
                self.sizes += [numel, bs, 1.0 / bs, bool(accumulate), nchunks]
            else:           # name_hashes, n, bs, inv_bs, nchunks, npay, pw, psoff, chunk, last numel, last psoff
                self.kernel, self.sig = ("block_decode_multi", _B.make_decode_multi, spec), SIG_DECODE_MULTI
                self.sizes += [nch, numel, bs, 1.0 / bs, nchunks, 1, pw, psoff, *tail]
            self._nh, self._np = 8, 13

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        if self.numel == 0 and (expect is None or status is None):
            return                          # (else the kernel checks the header alone)
        raw = self._raw or self._prepared()
        s = raw.slots                       # (set_check inlined: the tiny call's cost)
        pp = s[0].value = _ptr(payload)
        s[1].value = pp + self.codes_off
        s[2].value = pp + self.scales_off
        s[3].value = _ptr(out)
        if status is not None and expect is raw._expect:
            s[4].value = _ptr(status)
        else:
            raw.set_check(4, status, expect)
        raw.launch(self.grid, BLOCK, _stream(stream))

    def bind(self, h, expect):
        _, pay, to_out, stream, status = h
        return lambda payload, out: self(pay(payload), to_out(out)[0], stream(out), status, expect)

    def _launch(self, payloads, n, out, stream, status, expect, name_hashes):
        if name_hashes is not None and expect is None:
            if self._names_only is None:
                raise ValueError("checking QSGD chunks needs expect (it gives the mode and norm)")
            expect = self._names_only
        if self.numel == 0 and (expect is None or status is None):
            return
        raw = self._prepared()
        s = raw.slots
        raw.set_payloads(0, _ptr(payloads), n, self.total)
        s[3].value = _ptr(out)
        raw.set_check(4, status, expect, (name_hashes is not None) if self.mode == MULTI_CHUNKS else None)
        s[self._nh].value = 0 if name_hashes is None else _ptr(name_hashes)
        s[self._np].value = int(n)
        raw.launch(self.grid, BLOCK, _stream(stream))


class _DecodeSum(_Decode):
    """``(payloads, n, out, stream, status, expect)``."""
    mode = MULTI_SUM

    def __call__(self, payloads, n, out, stream=None, status=None, expect=None):
        self._launch(payloads, n, out, stream, status, expect, None)

    def bind(self, h, expect):
        _, pay, to_out, stream, status = h
        return lambda payloads, n, out: self._launch(pay(payloads), n, to_out(out)[0], stream(out), status,
                                                     expect, None)


class _DecodeChunks(_Decode):
    """``(gathered, out, stream, status, name_hashes, expect)``."""
    mode = MULTI_CHUNKS

    def __call__(self, gathered, out, stream=None, status=None, name_hashes=None, expect=None):
        self._launch(gathered, 1, out, stream, status, expect, name_hashes)

    def bind(self, h, name_hashes, expect):
        _, pay, to_out, stream, status = h
        return lambda gathered, out: self._launch(pay(gathered), 1, to_out(out)[0], stream(out), status, expect,
                                                  name_hashes)


# ---- the table: QSGD's and 1-bit's parameters to each kind's prepared op -------------------------------

def _qsgd(cls, numel, bits, bucket_size, stochastic, norm_l2):
    lay = wire.layout(wire.METHODS["qsgd"], numel, bits, bucket_size)
    return cls(numel, bits, bucket_size, L2 if norm_l2 else MAX, PACK_STOCH if stochastic else PACK_DET, lay)


def _onebit(cls, numel, bucket_size, two_mean):
    lay = wire.layout(wire.METHODS["onebit"], numel, 1, bucket_size, wire.onebit_mode(two_mean))
    return cls(numel, 1, bucket_size or max(numel, 1), TWO_MEAN if two_mean else MEAN_ABS, PACK_ONEBIT, lay)


# (method, kind) -> the prepared op's factory, with the same keyword parameters as numba_kernels.cpu's
# (numba_kernels.cuda adds SortQuant's and KMeans')
PREPARE = {
    ("qsgd", "encode"): partial(_qsgd, _Encode),
    ("qsgd", "reduce_requantize"): partial(_qsgd, _ReduceRequantize),
    ("qsgd", "decode"): lambda numel, bits, bucket_size, accumulate: _Decode(numel, bits, bucket_size, None,
                                                                             accumulate),
    ("qsgd", "decode_sum"): lambda numel, bits, bucket_size: _DecodeSum(numel, bits, bucket_size, None),
    ("qsgd", "decode_chunks"): lambda numel, bits, bucket_size, chunk: _DecodeChunks(
        numel, bits, bucket_size, None, chunk=chunk),
    ("onebit", "encode"): partial(_onebit, _Encode),
    ("onebit", "reduce_requantize"): partial(_onebit, _ReduceRequantize),
    ("onebit", "decode"): lambda numel, bucket_size, two_mean, accumulate: _Decode(
        numel, 1, bucket_size, bool(two_mean), accumulate),
    ("onebit", "decode_sum"): lambda numel, bucket_size, two_mean: _DecodeSum(
        numel, 1, bucket_size, bool(two_mean)),
    ("onebit", "decode_chunks"): lambda numel, bucket_size, two_mean, chunk: _DecodeChunks(
        numel, 1, bucket_size, bool(two_mean), chunk=chunk),
}
