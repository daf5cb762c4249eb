"""Numba CUDA kernels behind one prepared op per codec and kind (:data:`PREPARE`, reached through
:func:`numba_kernels.prepare`), bit-identical to ``*_ref``; they also run in the CUDA simulator.

Two kernel paths, chosen per configuration, with the same results:

* the warp path (``numba_kernels/_cuda_warp.py``: one warp per bucket) for bit widths dividing 32 and
  buckets of 32..FUSE_MAX elements holding whole 32-bit code words (``_cuda_warp.supported``);
* the general path (``numba_kernels/_cuda_block.py``) for everything else: a fused one-launch encode
  (a block owns whole buckets) for buckets of at most FUSE_MAX elements; above that (OneBit's one
  bucket per tensor included) the scales' two kernels (a warp per segment of 8192 elements, then a
  warp per bucket), then the encode in pack-only mode; a grid-stride decode.

Import this module lazily (``numba_kernels.cuda`` is loaded on first attribute access): importing it
imports ``numba.cuda``, and ``NUMBA_ENABLE_CUDASIM`` must be set before that happens.

An op is prepared once per configuration: it holds the chosen kernel, compiled for one fixed
signature (1-D C-contiguous arrays), its grid, the payload's layout and, on hardware, the kernel's
parameter buffer, built once: a call writes the few pointers and scalars that change into it and calls
``cuLaunchKernel`` directly (no dispatcher, no argument typing). Arrays are Numba device arrays, any
object with ``__cuda_array_interface__``, or (QSGD and 1-bit) a device pointer as an int; they must be
contiguous, of the prepared size and dtype (the ops do not check). Streams: 0/None (the default
stream), a Numba stream, or a raw ``CUstream`` handle as an int. In the simulator the same objects
launch the same kernels through the ordinary dispatcher (it has no ``cuLaunchKernel``). Nothing here
synchronises with the host. A prepared op assumes one device per process (Horovod's model).
SortQuant and KMeans launch through Numba's dispatcher (several kernels per encode; not tuned yet).

Decoders take ``expect`` (a ``wire.Expect``): the header check then runs inside the decode kernel (a
bad payload decodes to NaN, its error bits go to ``status[0]`` and are ORed into ``status[1]``); with
``expect=None`` and a ``status``, the decode writes NaN where ``status[0] != 0`` (the result of an
earlier ``check_header_cuda``). Encoders take ``residual``: see ``numba_kernels.reference``.

Fused operations (several payloads per launch; definitions in ``numba_kernels.reference``), on the
kernel path the configuration selects, like the single-payload launches:

* ``decode_sum`` ``(payloads, n, out, stream, status, expect)``: one launch of the warp decode in its
  sum mode (a whole bucket's partial sums kept in registers over the n payloads) or of ``block_decode_multi`` (each thread keeps its elements' partial sums);
  any bad payload makes the whole ``out`` NaN (status: the OR of the errors).
* ``decode_chunks`` ``(gathered, out, stream, status, name_hashes, expect)``: one launch of the warp
  decode in its chunks mode (bucket b from its chunk's payload) or of ``block_decode_multi``; a bad
  chunk decodes to NaN; at most MAXCH chunks.
* ``reduce_requantize`` ``(payloads, n, residual, out_payload, header, key, stream, status, expect)``:
  one launch of the warp or general encode (on the general path, buckets above FUSE_MAX take three:
  the scales' two, then the pack) whose values
  are the payloads' sum plus ``residual``, recomputed where the encode reads them (no float32 array
  in global memory); a bad payload makes the sum NaN.
"""
import threading

import numpy as np
from numba import cuda

from . import _cuda_kmeans as _KM
from . import _cuda_sortquant as _S
from . import wire
from ._cuda_device import BLOCK, SIMULATOR
from ._cuda_prepared import (_grid, _kernel, _nb_stream, _stream, _zero_status, check_header_cuda, FUSE_MAX,
                             kernel_path, kernels, MAXCH, PREPARE, SORTQUANT_MAX_BUCKET, write_header_cuda)


__all__ = ["PREPARE", "write_header_cuda", "check_header_cuda", "kernel_path", "kernels", "SIMULATOR", "BLOCK",
           "FUSE_MAX", "MAXCH", "SORTQUANT_MAX_BUCKET"]


# ---- SortQuant and KMeans: several dispatcher launches per op ------------------------------------------

class _Scratch(threading.local):
    """This thread's device scratch (:func:`_scratch`)."""

    def __init__(self):
        self.table = {}


_SCRATCH = _Scratch()


def _scratch(key, make):
    """The device scratch ``make()`` built once per ``key`` (what, sizes, stream handle) on this
    thread: a thread's work on one stream runs in order, so its calls share it (SortQuant and KMeans
    the same codes array); another thread's launches could fall between an encode's kernels, so
    threads never share one. At most 64 kept per thread (one device per process)."""
    table = _SCRATCH.table
    got = table.get(key)
    if got is None:
        if len(table) >= 64:
            table.clear()
        got = table[key] = make()
    return got


def _as_dev(a):
    """A Numba device array view of ``a`` (as it is in the simulator, whose arrays have no
    ``__cuda_array_interface__``)."""
    return a if SIMULATOR or isinstance(a, cuda.devicearray.DeviceNDArray) else cuda.as_cuda_array(a)


def _codes_scratch(n, stream):
    return _scratch(("codes", n, _stream(stream)), lambda: cuda.device_array(n, np.uint16))


def _residual_arg(residual):
    if residual is None:
        return _scratch(("no residual",), lambda: cuda.to_device(np.zeros(1, np.float32))), False
    return _as_dev(residual), True


def _pack(codes, payload, lay, bits, s):
    nwords = (lay.scales_offset - lay.codes_offset) // 4
    kernels.setdefault(("sortquant_pack",), _S.k_pack)
    _S.k_pack[min(_grid(nwords, BLOCK), 1024), BLOCK, s](codes, payload, lay.codes_offset, nwords, bits)


class _SortquantEncode:
    """``(x, payload, header, key, stream=None, residual=None)``: a block per bucket sorts it
    (``_cuda_sortquant``), then the codes are packed; buckets of at most SORTQUANT_MAX_BUCKET."""
    __slots__ = ("numel", "total", "lay", "bits", "split_bits", "bs", "stochastic", "P")

    def __init__(self, numel, bits, split_bits, bucket_size, stochastic):
        if bucket_size > _S.MAX_BUCKET:
            raise ValueError(f"sortquant on CUDA sorts a bucket in shared memory: bucket_size must be at most "
                             f"{_S.MAX_BUCKET}, got {bucket_size}")
        self.lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
        self.numel, self.total = numel, self.lay.total
        self.bits, self.split_bits, self.bs, self.stochastic = bits, split_bits, bucket_size, bool(stochastic)
        self.P = 1 << max(0, (min(bucket_size, numel) - 1).bit_length())

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        payload = _as_dev(payload)
        write_header_cuda(payload, header, stream)
        if not self.numel:
            return
        s, lay = _nb_stream(stream), self.lay
        codes = _codes_scratch(self.numel, stream)
        enc = _kernel("sortquant_encode", lambda spec: _S.make_encode(spec[0]), (self.P,))
        scales = payload[lay.scales_offset:lay.total].view(np.float32)
        res, has = _residual_arg(residual)
        enc[lay.nbuckets, min(self.P, BLOCK), s](_as_dev(x), scales, codes, self.bs, self.split_bits,
                                                 self.bits - self.split_bits, self.stochastic, np.uint64(key),
                                                 res, has)
        _pack(codes, payload, lay, self.bits, s)


class _KmeansEncode:
    """``(x, payload, header, key, stream=None, residual=None)``: ``iters + 5`` launches after the
    header's (``_cuda_kmeans``); ``bucket_size`` 0 is one bucket per tensor."""
    __slots__ = ("numel", "total", "lay", "bits", "bs", "iters")

    def __init__(self, numel, bits, bucket_size, iters):
        self.lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
        self.numel, self.total = numel, self.lay.total
        self.bits, self.bs, self.iters = bits, bucket_size or numel, iters

    def __call__(self, x, payload, header, key, stream=None, residual=None):
        payload = _as_dev(payload)
        write_header_cuda(payload, header, stream)
        n, lay, bs, bits = self.numel, self.lay, self.bs, self.bits
        if not n:
            return
        s = _nb_stream(stream)
        nb, K = lay.nbuckets, 1 << bits
        cells = nb << bits
        cent, amax, lo, hi, total, count = _scratch(("kmeans", n, bs, bits, _stream(stream)), lambda: (
            cuda.device_array((2, cells), np.float32), cuda.device_array(nb, np.uint32),
            cuda.device_array(nb, np.float32), cuda.device_array(nb, np.float32),
            cuda.device_array((3, cells), np.int64), cuda.device_array((3, cells), np.int64)))
        codes = _codes_scratch(n, stream)
        xd = _as_dev(x)
        tpb = -(-bs // _KM.TILE)
        grid = nb * tpb
        book = payload[lay.scales_offset:lay.total].view(np.float32)
        res, has = _residual_arg(residual)
        for name, k in (("kmeans_clear", _KM.k_clear), ("kmeans_stats", _KM.k_stats),
                        ("kmeans_start", _KM.k_start), ("kmeans_step", _KM.k_step)):
            kernels.setdefault((name,), k)
        _KM.k_clear[min(_grid(nb * K, BLOCK), 1024), BLOCK, s](amax, lo, hi, total, count)
        _KM.k_stats[grid, BLOCK, s](xd, xd.view(np.uint32), amax, lo, hi, bs, tpb)
        _KM.k_start[nb, BLOCK, s](xd, cent, amax, lo, hi, bs, K, np.uint64(key))
        for t in range(1, self.iters + 2):
            _KM.k_step[grid, BLOCK, s](xd, cent, amax, total, count, bs, tpb, K, t, t > self.iters, book, codes,
                                       res, has)
        _pack(codes, payload, lay, bits, s)


class _LookupDecode:
    """``(payload, out, stream=None, status=None, expect=None)`` of SortQuant and KMeans (a scale or
    codebook lookup per element): the header checked first when ``expect`` is given (by the check
    kernel, into ``status``), then ``kernel(payload, scales, out, codes_offset, *params, status,
    check)`` over ``out``."""
    __slots__ = ("numel", "total", "name", "kernel", "lay", "params")

    def __init__(self, name, kernel, lay, *params):
        self.name, self.kernel, self.lay, self.params = name, kernel, lay, params
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
        kernels.setdefault((self.name,), self.kernel)
        self.kernel[min(_grid(lay.numel, BLOCK), 4096), BLOCK, _nb_stream(stream)](
            payload, payload[lay.scales_offset:lay.total].view(np.float32), _as_dev(out), lay.codes_offset,
            *self.params, _as_dev(status) if check else _zero_status(), check)


def _sortquant_decode(numel, bits, split_bits, bucket_size, accumulate):
    lay = wire.layout(wire.METHODS["sortquant"], numel, bits, bucket_size, 0, split_bits)
    return _LookupDecode("sortquant_decode", _S.k_decode, lay, bucket_size, split_bits, bits, bool(accumulate))


def _kmeans_decode(numel, bits, bucket_size, accumulate):
    lay = wire.layout(wire.METHODS["kmeans"], numel, bits, bucket_size)
    return _LookupDecode("kmeans_decode", _KM.k_decode, lay, bucket_size or numel, bits, bool(accumulate))


PREPARE.update({
    ("sortquant", "encode"): _SortquantEncode,
    ("sortquant", "decode"): _sortquant_decode,
    ("kmeans", "encode"): _KmeansEncode,
    ("kmeans", "decode"): _kmeans_decode,
})
