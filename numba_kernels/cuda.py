"""Numba CUDA kernels behind one prepared op per codec and kind (:data:`PREPARE`, reached through
:func:`numba_kernels.prepare`), bit-identical to ``*_ref``; they also run in the CUDA simulator.
QSGD's and 1-bit's ops are in ``_cuda_prepared``, SortQuant's and KMeans' below (docs/ARCHITECTURE.md).
Import this module lazily: ``NUMBA_ENABLE_CUDASIM`` must be set before ``numba.cuda`` is imported.

Arrays: Numba device arrays, ``__cuda_array_interface__`` objects or (QSGD and 1-bit) device pointers as
ints, contiguous, of the prepared size and dtype (not checked). Streams: 0/None, a Numba stream or a raw
``CUstream`` handle as an int. Nothing here synchronises with the host; one device per process. Decoders
take ``expect`` (a ``wire.Expect``): the header check runs in the decode (a bad payload decodes to NaN,
its error bits go to ``status[0]`` and are ORed into ``status[1]``); with ``expect=None`` and a
``status``, the decode writes NaN where ``status[0] != 0`` (an earlier ``check_header_cuda``). Encoders
take ``residual``. A bad payload makes every value of ``decode_sum`` and ``reduce_requantize`` NaN, and
only its own chunk in ``decode_chunks`` (at most MAXCH chunks).
"""
import threading

import numpy as np
from numba import cuda

from . import _cuda_kmeans as _KM
from . import _cuda_sortquant as _S
from . import wire
from ._cuda_device import BLOCK, SIMULATOR
from ._cuda_prepared import (_grid, _kernel, _nb_stream, _stream, _zero_status, check_header_cuda, FUSE_MAX,
                             kernel_path, kernels, MAXCH, PREPARE, write_header_cuda)

__all__ = ["PREPARE", "write_header_cuda", "check_header_cuda", "kernel_path", "kernels", "SIMULATOR", "BLOCK",
           "FUSE_MAX", "MAXCH", "SORTQUANT_MAX_BUCKET"]

SORTQUANT_MAX_BUCKET = _S.MAX_BUCKET        # (a bucket sorts in shared memory)


# ---- SortQuant and KMeans: several dispatcher launches per op ------------------------------------------

class _Scratch(threading.local):
    def __init__(self):
        self.table = {}


_SCRATCH = _Scratch()


def _scratch(key, make):
    """The device scratch ``make()`` built once per ``key`` (what, sizes, stream handle) on this
    thread: a thread's work on one stream runs in order, so its calls share it; another thread's
    launches could fall between an encode's kernels, so threads never share one. At most 64 kept."""
    table = _SCRATCH.table
    got = table.get(key)
    if got is None:
        if len(table) >= 64:
            table.clear()
        got = table[key] = make()
    return got


def _as_dev(a):
    """A Numba device array view of ``a`` (as it is in the simulator: no ``__cuda_array_interface__``)."""
    return a if SIMULATOR or isinstance(a, cuda.devicearray.DeviceNDArray) else cuda.as_cuda_array(a)


def _run(name, kernel):
    """``kernel`` (a dispatcher), noted in :data:`kernels` as launched."""
    kernels.setdefault((name,), kernel)
    return kernel


class _CodesEncode:
    """``(x, payload, header, key, stream=None, residual=None)`` of SortQuant and KMeans: the header,
    then ``_codes`` (each element's code into a uint16 scratch array, the scales into the payload),
    then ``k_pack`` packs the codes."""

    def __init__(self, lay, bits, bs):
        self.lay, self.numel, self.total, self.bits, self.bs = lay, lay.numel, lay.total, bits, bs

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        payload = _as_dev(payload)
        write_header_cuda(payload, header, stream)
        n, lay = self.numel, self.lay
        if not n:
            return
        s = _nb_stream(stream)
        codes = _scratch(("codes", n, _stream(stream)), lambda: cuda.device_array(n, np.uint16))
        if residual is None:
            res, has = _scratch(("no residual",), lambda: cuda.to_device(np.zeros(1, np.float32))), False
        else:
            res, has = _as_dev(residual), True
        scales = payload[lay.scales_offset:lay.total].view(np.float32)
        self._codes(_as_dev(x), scales, codes, np.uint64(key), res, has, s, stream)
        nwords = (lay.scales_offset - lay.codes_offset) // 4
        _run("sortquant_pack", _S.k_pack)[min(_grid(nwords, BLOCK), 1024), BLOCK, s](
            codes, payload, lay.codes_offset, nwords, self.bits)


class _SortquantEncode(_CodesEncode):
    """A block per bucket sorts it (``_cuda_sortquant``); buckets of at most SORTQUANT_MAX_BUCKET."""

    def __init__(self, numel, bits, split_bits, bucket_size, stochastic):
        if bucket_size > _S.MAX_BUCKET:
            raise ValueError(f"sortquant on CUDA sorts a bucket in shared memory: bucket_size must be at most "
                             f"{_S.MAX_BUCKET}, got {bucket_size}")
        super().__init__(wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits), bits,
                         bucket_size)
        self.split_bits, self.stochastic = split_bits, bool(stochastic)
        self.P = 1 << max(0, (min(bucket_size, numel) - 1).bit_length())

    def _codes(self, x, scales, codes, key, res, has, s, stream):
        enc = _kernel("sortquant_encode", lambda spec: _S.make_encode(spec[0]), (self.P,))
        enc[self.lay.nbuckets, min(self.P, BLOCK), s](x, scales, codes, self.bs, self.split_bits,
                                                      self.bits - self.split_bits, self.stochastic, key, res,
                                                      has)


class _KmeansEncode(_CodesEncode):
    """``iters + 5`` launches after the header's (``_cuda_kmeans``); ``bucket_size`` 0 is one bucket
    per tensor."""

    def __init__(self, numel, bits, bucket_size, iters):
        super().__init__(wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size), bits, bucket_size or numel)
        self.iters = iters

    def _codes(self, x, book, codes, key, res, has, s, stream):
        n, bs, bits = self.numel, self.bs, self.bits
        nb, K = self.lay.nbuckets, 1 << bits
        cells = nb << bits
        cent, amax, lo, hi, total, count = _scratch(("kmeans", n, bs, bits, _stream(stream)), lambda: (
            cuda.device_array((2, cells), np.float32), cuda.device_array(nb, np.uint32),
            cuda.device_array(nb, np.float32), cuda.device_array(nb, np.float32),
            cuda.device_array((3, cells), np.int64), cuda.device_array((3, cells), np.int64)))
        tpb = -(-bs // _KM.TILE)
        grid = nb * tpb
        _run("kmeans_clear", _KM.k_clear)[min(_grid(nb * K, BLOCK), 1024), BLOCK, s](amax, lo, hi, total, count)
        _run("kmeans_stats", _KM.k_stats)[grid, BLOCK, s](x, x.view(np.uint32), amax, lo, hi, bs, tpb)
        _run("kmeans_start", _KM.k_start)[nb, BLOCK, s](x, cent, amax, lo, hi, bs, K, key)
        step = _run("kmeans_step", _KM.k_step)
        for t in range(1, self.iters + 2):
            step[grid, BLOCK, s](x, cent, amax, total, count, bs, tpb, K, t, t > self.iters, book, codes, res,
                                 has)


class _LookupDecode:
    """``(payload, out, stream=None, status=None, expect=None)`` of SortQuant and KMeans (a scale or
    codebook lookup per element): the header checked first when ``expect`` is given (by the check
    kernel, into ``status``), then ``kernel(payload, scales, out, codes_offset, *params, status,
    check)`` over ``out``; ``method``'s layout from ``lay_args``."""
    __slots__ = ("numel", "total", "name", "kernel", "lay", "params")

    def __init__(self, method, kernel, lay_args, *params):
        self.name, self.kernel, self.params = method + "_decode", kernel, params
        self.lay = lay = wire.layout(wire.METHODS[method], *lay_args)
        self.numel, self.total = lay.numel, lay.total

    def __call__(self, payload, out, stream=None, status=None, expect=None):
        payload = _as_dev(payload)
        if expect is not None:
            if status is None:
                status = cuda.to_device(np.zeros(2, np.int32))
            check_header_cuda(payload, status, expect, stream)
        if not self.numel:
            return
        lay, check = self.lay, status is not None
        _run(self.name, self.kernel)[min(_grid(lay.numel, BLOCK), 4096), BLOCK, _nb_stream(stream)](
            payload, payload[lay.scales_offset:lay.total].view(np.float32), _as_dev(out), lay.codes_offset,
            *self.params, _as_dev(status) if check else _zero_status(), check)


PREPARE.update({
    ("sortquant", "encode"): _SortquantEncode,
    ("sortquant", "decode"): lambda numel, bits, split_bits, bucket_size, accumulate: _LookupDecode(
        "sortquant", _S.k_decode, (numel, bits, bucket_size, 0, split_bits), bucket_size, split_bits, bits,
        bool(accumulate)),
    ("kmeans", "encode"): _KmeansEncode,
    ("kmeans", "decode"): lambda numel, bits, bucket_size, accumulate: _LookupDecode(
        "kmeans", _KM.k_decode, (numel, bits, bucket_size), bucket_size or numel, bits, bool(accumulate)),
})
