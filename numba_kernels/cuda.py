"""Numba CUDA kernels (``*_cuda``), bit-identical to ``*_ref``; they also run in the CUDA simulator.

Two kernel paths, chosen per configuration, with the same results:

* the warp path (``numba_kernels/_cuda_warp.py``: one warp per bucket) for bit widths dividing 32 and
  buckets of 32..FUSE_MAX elements holding whole 32-bit code words (``_cuda_warp.supported``);
* the general path (``numba_kernels/_cuda_block.py``) for everything else: a fused one-launch encode
  (a block owns whole buckets) for buckets of at most FUSE_MAX elements; above that (OneBit's one
  bucket per tensor included) the scales' two kernels (a warp per segment of 8192 elements, then a
  warp per bucket), then the encode in pack-only mode; a grid-stride decode.

Import this module lazily (``numba_kernels.cuda`` is loaded on first attribute access): importing it
imports ``numba.cuda``, and ``NUMBA_ENABLE_CUDASIM`` must be set before that happens.

Launches are prepared once per configuration: ``prepare_qsgd_encode(numel, bits, bucket_size,
stochastic, norm_l2)`` etc. return objects that hold the chosen kernel, compiled for one fixed
signature (1-D C-contiguous arrays), its grid, the payload's layout and, on hardware, the kernel's
parameter buffer, built once: a call writes the few pointers and scalars that change into it and calls
``cuLaunchKernel`` directly (no dispatcher, no argument typing). Arrays are Numba device arrays, any
object with ``__cuda_array_interface__``, or (prepared launches only) a device pointer as an int; they
must be contiguous, of the prepared size and dtype (prepared launches do not check). Streams: 0/None
(the default stream), a Numba stream, or a raw ``CUstream`` handle as an int. The plain ``*_cuda``
launchers check their arguments and use the prepared launches through a cache keyed by ints. In the
simulator the same objects launch through the ordinary dispatcher. Nothing here synchronises with the
host. A prepared launch and the launchers' cache assume one device per process (Horovod's model).

Decoders take ``expect`` (a ``wire.Expect``): the header check then runs inside the decode kernel (a
bad payload decodes to NaN, its error bits go to ``status[0]`` and are ORed into ``status[1]``); with
``expect=None`` and a ``status``, the decode writes NaN where ``status[0] != 0`` (the result of an
earlier ``check_header_cuda``). Encoders take ``residual``: see ``numba_kernels.reference``.

Fused operations (several payloads per launch; definitions in ``numba_kernels.reference``), on the
kernel path the configuration selects, like the single-payload launches:

* ``*_decode_sum_cuda`` / ``prepare_*_decode_sum`` ``(payloads, n, out, stream, status, expect)``:
  one launch of the warp decode in its sum mode (a whole bucket's partial sums kept in registers
  over the n payloads) or of ``block_decode_multi`` (each thread keeps its elements' partial sums);
  any bad payload makes the whole ``out`` NaN (status: the OR of the errors).
* ``*_decode_chunks_cuda`` / ``prepare_*_decode_chunks`` ``(gathered, out, stream, status,
  name_hashes, expect)``: one launch of the warp decode in its chunks mode (bucket b from its chunk's
  payload) or of ``block_decode_multi``; a bad chunk decodes to NaN; at most MAXCH chunks.
* ``*_reduce_requantize_cuda`` / ``prepare_*_reduce_requantize`` ``(payloads, n, residual,
  out_payload, header, key, stream, status, expect)``: one launch of the warp or general encode (on
  the general path, buckets above FUSE_MAX take three: the scales' two, then the pack) whose values
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
from ._cuda_launch import (_grid, _kernel, _nb_stream, _sim_stream, _stream, _zero_status, check_header_cuda,
                           FUSE_MAX, kernel_path, kernels, MAXCH, SORTQUANT_MAX_BUCKET, write_header_cuda)
from ._cuda_prepared import (prepare_onebit_decode, prepare_onebit_decode_chunks, prepare_onebit_decode_sum,
                             prepare_onebit_encode, prepare_onebit_reduce_requantize, prepare_qsgd_decode,
                             prepare_qsgd_decode_chunks, prepare_qsgd_decode_sum, prepare_qsgd_encode,
                             prepare_qsgd_reduce_requantize)
from ._memo import memo


__all__ = ["qsgd_encode_cuda", "qsgd_decode_cuda", "onebit_encode_cuda", "onebit_decode_cuda",
           "write_header_cuda", "check_header_cuda", "prepare_qsgd_encode", "prepare_qsgd_decode",
           "prepare_onebit_encode", "prepare_onebit_decode", "kernel_path", "kernels", "SIMULATOR",
           "BLOCK", "FUSE_MAX", "qsgd_decode_sum_cuda", "onebit_decode_sum_cuda",
           "qsgd_reduce_requantize_cuda", "onebit_reduce_requantize_cuda", "qsgd_decode_chunks_cuda",
           "onebit_decode_chunks_cuda", "prepare_qsgd_decode_sum", "prepare_onebit_decode_sum",
           "prepare_qsgd_reduce_requantize", "prepare_onebit_reduce_requantize",
           "prepare_qsgd_decode_chunks", "prepare_onebit_decode_chunks", "MAXCH",
           "sortquant_encode_cuda", "sortquant_decode_cuda", "SORTQUANT_MAX_BUCKET", "kmeans_encode_cuda",
           "kmeans_decode_cuda"]


# ---- plain launchers (same signatures as numba_kernels.reference) --------------------------------------

class _Launches(threading.local):
    """This thread's prepared launches of the plain launchers (``table``) and device scratch
    (``scratch``, :func:`_scratch`): a prepared launch writes its parameter buffer and scratch on
    every call, so threads never share one."""

    def __init__(self):
        self.table = {}
        self.scratch = {}


_LAUNCHES = _Launches()


def _cached(key, make, *args):
    """``make(*args)``, prepared once per ``key`` on this thread."""
    return memo(_LAUNCHES.table, key, make, *args)


def _size_of(a, what, typestr):
    """Element count of a contiguous device array with ``typestr``, else TypeError."""
    if SIMULATOR:           # (simulated arrays have no __cuda_array_interface__)
        if np.dtype(a.dtype).str != typestr or not (a.flags["C_CONTIGUOUS"] or a.size <= 1):
            raise TypeError(f"{what} must be a C-contiguous {typestr} array; got {a.dtype} "
                            f"shape {a.shape}")
        return a.size
    cai = a.__cuda_array_interface__
    if cai["typestr"] != typestr:
        raise TypeError(f"{what} must have dtype {typestr}; got {cai['typestr']}")
    shape = cai["shape"]
    n = 1
    for d in shape:
        n *= d
    strides = cai.get("strides")
    if strides is not None and n > 1:
        item = int(typestr[2:])
        want = item
        for d, s in zip(reversed(shape), reversed(strides)):
            if d > 1 and s != want:
                raise TypeError(f"{what} must be C-contiguous; got shape {shape} strides {strides}")
            want *= d
    return n


def _check_payload(payload, total):
    n = _size_of(payload, "payload", "|u1")
    if n != total:
        raise wire.PayloadError(f"payload has {n} bytes, expected {total}")


def qsgd_encode_cuda(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=0,
                     residual=None):
    """Bucketed QSGD encode of a float32 device array into a uint8 device payload."""
    n = _size_of(x, "x", "<f4")
    p = _cached((0, n, bits, bucket_size, stochastic, norm_l2), prepare_qsgd_encode, n, bits, bucket_size,
                stochastic, norm_l2)
    _check_payload(payload, p.total)
    if residual is not None and _size_of(residual, "residual", "<f4") != n:
        raise ValueError("residual must have x.size elements")
    p(x, payload, header, key, stream, residual)


def qsgd_decode_cuda(payload, out, bits, bucket_size, accumulate, stream=0, status=None, expect=None):
    """out (+)= dequantized QSGD payload; NaN on a bad header (``expect``) or ``status[0] != 0``."""
    n = _size_of(out, "out", "<f4")
    p = _cached((1, n, bits, bucket_size, accumulate), prepare_qsgd_decode, n, bits, bucket_size,
                accumulate)
    _check_payload(payload, p.total)
    p(payload, out, stream, status, expect)


def onebit_encode_cuda(x, payload, header, bucket_size, two_mean, stream=0, residual=None):
    """1-bit encode; ``bucket_size`` 0 = one bucket per tensor (the general path's reduce: a warp per
    segment of 8192 elements, then a warp per bucket over its segments' sums)."""
    n = _size_of(x, "x", "<f4")
    p = _cached((2, n, bucket_size, two_mean), prepare_onebit_encode, n, bucket_size, two_mean)
    _check_payload(payload, p.total)
    if residual is not None and _size_of(residual, "residual", "<f4") != n:
        raise ValueError("residual must have x.size elements")
    p(x, payload, header, 0, stream, residual)


def onebit_decode_cuda(payload, out, bucket_size, two_mean, accumulate, stream=0, status=None,
                       expect=None):
    """out (+)= 1-bit decoded payload; NaN on a bad header (``expect``) or ``status[0] != 0``."""
    n = _size_of(out, "out", "<f4")
    p = _cached((3, n, bucket_size, two_mean, accumulate), prepare_onebit_decode, n, bucket_size,
                two_mean, accumulate)
    _check_payload(payload, p.total)
    p(payload, out, stream, status, expect)


def _as_dev(a):
    """A Numba device array view of ``a`` (as it is in the simulator)."""
    return a if SIMULATOR or isinstance(a, cuda.devicearray.DeviceNDArray) else cuda.as_cuda_array(a)


def _scratch(key, make):
    """The device scratch ``make()`` built once per ``key`` (what, sizes, stream handle) on this
    thread: a thread's work on one stream runs in order, so its calls share it (SortQuant and KMeans
    the same codes array); another thread's launches could fall between an encode's kernels, so
    threads never share one. At most 64 kept per thread (one device per process)."""
    table = _LAUNCHES.scratch
    got = table.get(key)
    if got is None:
        if len(table) >= 64:
            table.clear()
        got = table[key] = make()
    return got


def _codes_scratch(n, stream):
    return _scratch(("codes", n, stream), lambda: cuda.device_array(n, np.uint16))


def _no_residual():
    return _scratch(("no residual",), lambda: cuda.to_device(np.zeros(1, np.float32)))


def sortquant_encode_cuda(x, payload, header, bits, split_bits, bucket_size, stochastic, key, stream=0,
                          residual=None):
    """Sort quantization of a float32 device array into a uint8 device payload (``_cuda_sortquant``):
    a block per bucket sorts it, then the codes are packed; buckets of at most SORTQUANT_MAX_BUCKET."""
    n = _size_of(x, "x", "<f4")
    lay = wire.layout(wire.METHODS["sortquant"], n, bits, bucket_size, 0, split_bits)
    _check_payload(payload, lay.total)
    if bucket_size > _S.MAX_BUCKET:
        raise ValueError(f"sortquant on CUDA sorts a bucket in shared memory: bucket_size must be at most "
                         f"{_S.MAX_BUCKET}, got {bucket_size}")
    if residual is not None and _size_of(residual, "residual", "<f4") != n:
        raise ValueError("residual must have x.size elements")
    s = _sim_stream(stream) if SIMULATOR else _nb_stream(stream)
    payload = _as_dev(payload)
    write_header_cuda(payload, header, stream)
    if not n:
        return
    codes = _codes_scratch(n, _stream(stream) if not SIMULATOR else 0)
    P = 1 << max(0, (min(bucket_size, n) - 1).bit_length())
    enc = _kernel("sortquant_encode", lambda spec: _S.make_encode(spec[0]), (P,))
    scales = payload[lay.scales_offset:lay.total].view(np.float32)
    res = _no_residual() if residual is None else _as_dev(residual)
    enc[lay.nbuckets, min(P, BLOCK), s](_as_dev(x), scales, codes, bucket_size, split_bits, bits - split_bits,
                                        bool(stochastic), np.uint64(key), res, residual is not None)
    nwords = (lay.scales_offset - lay.codes_offset) // 4
    kernels.setdefault(("sortquant_pack",), _S.k_pack)
    _S.k_pack[min(_grid(nwords, BLOCK), 1024), BLOCK, s](codes, payload, lay.codes_offset, nwords, bits)


def sortquant_decode_cuda(payload, out, bits, split_bits, bucket_size, accumulate, stream=0, status=None,
                          expect=None):
    """out (+)= decoded sort-quantized payload; NaN on a bad header (``expect``: checked first, by the
    check kernel) or where ``status[0] != 0``."""
    lay = wire.layout(wire.METHODS["sortquant"], _size_of(out, "out", "<f4"), bits, bucket_size, 0, split_bits)
    _lookup_decode("sortquant_decode", _S.k_decode, lay, payload, out, stream, status, expect,
                   bucket_size, split_bits, bits, bool(accumulate))


def _lookup_decode(name, kernel, lay, payload, out, stream, status, expect, *params):
    """The decodes of SortQuant and KMeans (a scale or codebook lookup per element): sizes checked,
    the header checked first when ``expect`` is given (by the check kernel, into ``status``), then
    ``kernel(payload, scales, out, codes_offset, *params, status, check)`` over ``out``."""
    _check_payload(payload, lay.total)
    payload = _as_dev(payload)
    if expect is not None:
        if status is None:
            status = cuda.to_device(np.zeros(2, np.int32))
        check_header_cuda(payload, status, expect, stream)
    if not lay.numel:
        return
    check = status is not None
    kernels.setdefault((name,), kernel)
    kernel[min(_grid(lay.numel, BLOCK), 4096), BLOCK, _sim_stream(stream) if SIMULATOR else _nb_stream(stream)](
        payload, payload[lay.scales_offset:lay.total].view(np.float32), _as_dev(out), lay.codes_offset, *params,
        _as_dev(status) if check else _zero_status(), check)


def _kmeans_scratch(n, bs, bits, stream):
    nb = -(-n // bs)
    cells = nb << bits
    return _scratch(("kmeans", n, bs, bits, stream), lambda: (
        cuda.device_array((2, cells), np.float32), cuda.device_array(nb, np.uint32),
        cuda.device_array(nb, np.float32), cuda.device_array(nb, np.float32),
        cuda.device_array((3, cells), np.int64), cuda.device_array((3, cells), np.int64)))


def kmeans_encode_cuda(x, payload, header, bits, bucket_size, iters, key, stream=0, residual=None):
    """KMeans encode of a float32 device array into a uint8 device payload (``_cuda_kmeans``):
    ``iters + 5`` launches after the header's; ``bucket_size`` 0 is one bucket per tensor."""
    n = _size_of(x, "x", "<f4")
    lay = wire.layout(wire.METHODS["kmeans"], n, bits, bucket_size)
    _check_payload(payload, lay.total)
    if residual is not None and _size_of(residual, "residual", "<f4") != n:
        raise ValueError("residual must have x.size elements")
    s = _sim_stream(stream) if SIMULATOR else _nb_stream(stream)
    payload = _as_dev(payload)
    write_header_cuda(payload, header, stream)
    if not n:
        return
    bs = bucket_size or n
    K = 1 << bits
    handle = _stream(stream) if not SIMULATOR else 0
    cent, amax, lo, hi, total, count = _kmeans_scratch(n, bs, bits, handle)
    codes = _codes_scratch(n, handle)
    xd = _as_dev(x)
    tpb = -(-bs // _KM.TILE)
    grid = lay.nbuckets * tpb
    book = payload[lay.scales_offset:lay.total].view(np.float32)
    res = _no_residual() if residual is None else _as_dev(residual)
    for name, k in (("kmeans_clear", _KM.k_clear), ("kmeans_stats", _KM.k_stats), ("kmeans_start", _KM.k_start),
                    ("kmeans_step", _KM.k_step), ("kmeans_pack", _S.k_pack)):
        kernels.setdefault((name,), k)
    _KM.k_clear[min(_grid(lay.nbuckets * K, BLOCK), 1024), BLOCK, s](amax, lo, hi, total, count)
    _KM.k_stats[grid, BLOCK, s](xd, xd.view(np.uint32), amax, lo, hi, bs, tpb)
    _KM.k_start[lay.nbuckets, BLOCK, s](xd, cent, amax, lo, hi, bs, K, np.uint64(key))
    for t in range(1, iters + 2):
        _KM.k_step[grid, BLOCK, s](xd, cent, amax, total, count, bs, tpb, K, t, t > iters, book, codes, res,
                                   residual is not None)
    nwords = (lay.scales_offset - lay.codes_offset) // 4
    _S.k_pack[min(_grid(nwords, BLOCK), 1024), BLOCK, s](codes, payload, lay.codes_offset, nwords, bits)


def kmeans_decode_cuda(payload, out, bits, bucket_size, accumulate, stream=0, status=None, expect=None):
    """out (+)= decoded KMeans payload; NaN on a bad header (``expect``: checked first, by the check
    kernel) or where ``status[0] != 0``."""
    n = _size_of(out, "out", "<f4")
    _lookup_decode("kmeans_decode", _KM.k_decode, wire.layout(wire.METHODS["kmeans"], n, bits, bucket_size),
                   payload, out, stream, status, expect, bucket_size or n, bits, bool(accumulate))


def _check_multi(payloads, n, total):
    if n < 1:
        raise ValueError(f"n must be at least 1; got {n}")
    m = _size_of(payloads, "payloads", "|u1")
    if m != n * total:
        raise wire.PayloadError(f"payloads has {m} bytes, {n} payloads of {total} need {n * total}")


def qsgd_decode_sum_cuda(payloads, n, out, bits, bucket_size, stream=0, status=None, expect=None):
    """out = the float32 sum of ``n`` QSGD payloads' decodes; NaN everywhere if one is bad."""
    m = _size_of(out, "out", "<f4")
    p = _cached((4, m, bits, bucket_size), prepare_qsgd_decode_sum, m, bits, bucket_size)
    _check_multi(payloads, n, p.total)
    p.decode_sum(payloads, n, out, stream, status, expect)


def onebit_decode_sum_cuda(payloads, n, out, bucket_size, two_mean, stream=0, status=None, expect=None):
    m = _size_of(out, "out", "<f4")
    p = _cached((5, m, bucket_size, two_mean), prepare_onebit_decode_sum, m, bucket_size, two_mean)
    _check_multi(payloads, n, p.total)
    p.decode_sum(payloads, n, out, stream, status, expect)


def _check_rr(p, payloads, n, residual, out_payload):
    _check_multi(payloads, n, p.total)
    _check_payload(out_payload, p.total)
    if residual is not None and _size_of(residual, "residual", "<f4") != p.numel:
        raise ValueError(f"residual must have {p.numel} elements (the header's numel)")


def qsgd_reduce_requantize_cuda(payloads, n, residual, out_payload, header, bits, bucket_size, stochastic,
                                norm_l2, key, stream=0, status=None, expect=None):
    """SRA's phase 2 in one launch (see ``qsgd_reduce_requantize_ref``); numel is the header's."""
    m = int(header[2])
    p = _cached((6, m, bits, bucket_size, stochastic, norm_l2), prepare_qsgd_reduce_requantize, m, bits,
                bucket_size, stochastic, norm_l2)
    _check_rr(p, payloads, n, residual, out_payload)
    p(payloads, n, residual, out_payload, header, key, stream, status, expect)


def onebit_reduce_requantize_cuda(payloads, n, residual, out_payload, header, bucket_size, two_mean,
                                  stream=0, status=None, expect=None):
    m = int(header[2])
    p = _cached((7, m, bucket_size, two_mean), prepare_onebit_reduce_requantize, m, bucket_size, two_mean)
    _check_rr(p, payloads, n, residual, out_payload)
    p(payloads, n, residual, out_payload, header, 0, stream, status, expect)


def _check_chunks(p, gathered, name_hashes):
    m = _size_of(gathered, "gathered", "|u1")
    if m != p.total:
        raise wire.PayloadError(f"gathered has {m} bytes, the chunks need {p.total}")
    if name_hashes is not None and _size_of(name_hashes, "name_hashes", "<u4") < len(p.offsets) - 1:
        raise ValueError(f"name_hashes needs one entry per chunk ({len(p.offsets) - 1})")


def qsgd_decode_chunks_cuda(gathered, out, bits, bucket_size, chunk, stream=0, status=None,
                            name_hashes=None, expect=None):
    """SRA's phase 3 in one launch (see ``qsgd_decode_chunks_ref``); a bad chunk decodes to NaN."""
    m = _size_of(out, "out", "<f4")
    p = _cached((8, m, bits, bucket_size, chunk), prepare_qsgd_decode_chunks, m, bits, bucket_size, chunk)
    _check_chunks(p, gathered, name_hashes)
    p.decode_chunks(gathered, out, stream, status, name_hashes, expect)


def onebit_decode_chunks_cuda(gathered, out, bucket_size, two_mean, chunk, stream=0, status=None,
                              name_hashes=None, expect=None):
    m = _size_of(out, "out", "<f4")
    p = _cached((9, m, bucket_size, two_mean, chunk), prepare_onebit_decode_chunks, m, bucket_size,
                two_mean, chunk)
    _check_chunks(p, gathered, name_hashes)
    p.decode_chunks(gathered, out, stream, status, name_hashes, expect)
