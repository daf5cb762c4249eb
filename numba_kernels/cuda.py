"""Numba CUDA kernels (``*_cuda``), bit-identical to ``*_ref``; they also run in the CUDA simulator.

Three implementations behind the same launchers, selected by ``HVD_QUANT_CUDA_KERNELS`` (read at
import; ``set_impl`` switches in-process): ``v3`` (default; one warp per bucket, in
``numba_kernels/_cuda_warp.py``, for bit widths dividing 32 and buckets of whole code words, v2's
kernels elsewhere: see the "v3" section at the end), ``v2`` (fused one-launch encode and decode, the
header check inside the decode, a cheaper launch path: see the "v2" section below) and ``v1`` (the
kernels described next, launched as before, unchanged).

Import this module lazily (``numba_kernels.cuda`` is loaded on first attribute access): importing it
imports ``numba.cuda``, and ``NUMBA_ENABLE_CUDASIM`` must be set before that happens.

Launchers own everything a caller should not: input checks, the empty-input early return, grid and
block choice, the stream (``stream=0``: the default stream; pass a Numba stream, e.g.
``numba.cuda.external_stream(torch.cuda.current_stream().cuda_stream)``), and the kernels themselves
(compiled lazily, once per argument-type signature: every launcher passes arguments of fixed types,
so after the first call nothing recompiles). Nothing here synchronises with the host.

Kernels (all arrays are 1-D device arrays; ``payload`` is uint8 and its float32 scales are reached
through a view of the scales section):

* ``_k_reduce``: one group of 32 threads per bucket computes the bucket's scale(s) with the canonical
  order: lane ``l`` adds elements ``l, l+32, ...`` sequentially; a shared-memory tree (stride
  16, 8, 4, 2, 1) adds the lanes. Shared memory + ``syncthreads`` instead of warp shuffles gives the
  same arithmetic and also runs in the simulator. Products go through ``libdevice.fmul_rn``, which is
  never contracted into an FMA.
* ``_k_pack``: one thread per element computes its code into shared memory; then each thread
  assembles whole output bytes of the block's bit stream (a block of 256 elements owns exactly
  ``32*bits`` bytes), coalesced byte stores. Block 0 also writes the header and the padding.
* ``_k_decode``: one thread per element reads its ``bits`` bits (at most 3 bytes), looks up its
  bucket's scale and writes or adds its value. If ``status[0] != 0`` it writes NaN instead.
* ``_k_check``: one thread compares the payload header with what the receiver expects and stores the
  error bits (``wire.ERROR_BITS``) in ``status[0]`` (this payload) and ORs them into ``status[1]``
  (sticky, for the host to read whenever it chooses). This is how a device payload is validated
  without a host synchronisation: a bad payload decodes to NaN and leaves its reason in ``status``.
"""
import warnings

import numba
import numpy as np
from numba import cuda, float32, int32, int64

from . import wire
from ._scalar import F0, FNAN, U8, UFF, build

__all__ = ["qsgd_encode_cuda", "qsgd_decode_cuda", "onebit_encode_cuda", "onebit_decode_cuda",
           "write_header_cuda", "check_header_cuda", "kernels", "SIMULATOR", "BLOCK", "IMPLS", "impl",
           "set_impl", "flush_pending"]

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
# Threads per block. 256 on hardware; the simulator runs a Python thread per CUDA thread, so smaller.
BLOCK = 64 if SIMULATOR else 256
_SHARED = 256            # shared arrays are sized for the largest block

# The header check and header write are one-block kernels by design: silence Numba's occupancy hint
# for them (a message filter, so Numba's other performance warnings still show).
warnings.filterwarnings("ignore", message=r".*Grid size \d+ will likely result in GPU under-utilization")

if SIMULATOR:
    def _fmul_impl(a, b):
        return a * b
else:
    from numba.cuda import libdevice

    def _fmul_impl(a, b):
        return libdevice.fmul_rn(a, b)

_fmul = cuda.jit(device=True)(_fmul_impl)
_ops = build(cuda.jit(device=True), _fmul)
_qsgd_code = _ops.qsgd_code
_max_nan = _ops.max_nan
_finite = _ops.finite
_bucket_of = _ops.bucket_of
_mul = _ops.mul
_sqrt32 = _ops.sqrt32

# kinds for _k_reduce
MAX, L2, TWO_MEAN, MEAN_ABS = 0, 1, 2, 3
# kinds for _k_pack
PACK_DET, PACK_STOCH, PACK_ONEBIT = 0, 1, 2
# kinds for _k_decode
DEC_QSGD, DEC_TWO_MEAN, DEC_MEAN_ABS = 0, 1, 2


@cuda.jit(device=True)
def _add_term(kind, v, p, q, cnt):
    """One element ``v`` added to a lane's running reduction of kind ``kind`` (p: max, sum of squares,
    sum of the non-negatives or sum of |v|; q: sum of the negatives; cnt: count of the non-negatives).
    Lanes add their elements in order: the canonical summation order (module docstring)."""
    if kind == MAX:
        p = _max_nan(p, abs(v))
    elif kind == L2:
        p = p + _mul(v, v)
    elif kind == TWO_MEAN:
        if v >= F0:
            p = p + v
            cnt += 1
        else:
            q = q + v
    else:
        p = p + abs(v)
    return p, q, cnt


@cuda.jit
def _k_reduce(x, scales, numel, bs, nb, kind):
    tid = cuda.threadIdx.x
    lane = tid % 32
    b = cuda.blockIdx.x * (cuda.blockDim.x // 32) + tid // 32
    sp = cuda.shared.array(_SHARED, float32)
    sq = cuda.shared.array(_SHARED, float32)
    sc = cuda.shared.array(_SHARED, int64)
    p = F0
    q = F0
    cnt = 0
    st = b * bs
    en = min(numel, st + bs)
    if b < nb:
        i = st + lane
        while i < en:
            p, q, cnt = _add_term(kind, x[i], p, q, cnt)
            i += 32
    sp[tid] = p
    sq[tid] = q
    sc[tid] = cnt
    cuda.syncthreads()
    stride = 16
    while stride > 0:
        if lane < stride:
            if kind == MAX:
                sp[tid] = _max_nan(sp[tid], sp[tid + stride])
            else:
                sp[tid] = sp[tid] + sp[tid + stride]
                sq[tid] = sq[tid] + sq[tid + stride]
                sc[tid] = sc[tid] + sc[tid + stride]
        cuda.syncthreads()
        stride //= 2
    if lane == 0 and b < nb:
        p = sp[tid]
        if kind == MAX:
            scales[b] = p
        elif kind == L2:
            scales[b] = _sqrt32(p)
        elif kind == TWO_MEAN:
            npos = sc[tid]
            nneg = (en - st) - npos
            mp = F0
            mn = F0
            if npos > 0:
                mp = p / np.float32(npos)
            if nneg > 0:
                mn = sq[tid] / np.float32(nneg)
            if not (_finite(mp) and _finite(mn)):
                mp = FNAN
                mn = FNAN
            scales[2 * b] = mp
            scales[2 * b + 1] = mn
        else:
            scales[b] = p / np.float32(en - st)


@cuda.jit
def _k_pack(x, payload, scales, header, numel, codes_off, codes_nbytes, pad_end, bits, bs, inv_bs,
            kind, key):
    tid = cuda.threadIdx.x
    blk = cuda.blockIdx.x
    epb = cuda.blockDim.x
    codes = cuda.shared.array(_SHARED, int32)
    i = blk * epb + tid
    s = (1 << (bits - 1)) - 1
    sf = np.float32(s)
    c = 0
    if i < numel:
        v = x[i]
        if kind == PACK_ONEBIT:
            if v >= F0:
                c = 1
        else:
            b = _bucket_of(i, bs, inv_bs)
            scale = scales[b]
            c = _qsgd_code(v, scale, scale / sf, sf, s, kind == PACK_STOCH, key, i)
    codes[tid] = c
    cuda.syncthreads()
    nbytes_blk = (epb * bits) // 8
    inv_bits = 1.0 / bits
    j = tid
    while j < nbytes_blk:
        g = blk * nbytes_blk + j
        if g < codes_nbytes:
            bitpos = 8 * j
            e = np.int64(bitpos * inv_bits)
            if e * bits > bitpos:
                e -= 1
            elif (e + 1) * bits <= bitpos:
                e += 1
            off = bitpos - e * bits
            acc = np.int64(codes[e]) >> off
            nacc = bits - off
            e += 1
            while nacc < 8 and e < epb:
                acc |= np.int64(codes[e]) << nacc
                nacc += bits
                e += 1
            payload[codes_off + g] = acc & 0xFF
        j += epb
    if blk == 0:
        if tid < 64:
            payload[tid] = (header[tid >> 3] >> (U8 * np.uint64(tid & 7))) & UFF
        k = codes_off + codes_nbytes + tid
        if k < pad_end:
            payload[k] = 0


@cuda.jit
def _k_decode(payload, scales, out, status, numel, codes_off, bits, bs, inv_bs, kind, accumulate):
    i = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    if i >= numel:
        return
    s = (1 << (bits - 1)) - 1
    bitpos = i * bits
    byte = codes_off + (bitpos >> 3)
    sh = bitpos & 7
    w = np.int64(payload[byte])
    if sh + bits > 8:
        w |= np.int64(payload[byte + 1]) << 8
        if sh + bits > 16:
            w |= np.int64(payload[byte + 2]) << 16
    code = (w >> sh) & ((1 << bits) - 1)
    b = _bucket_of(i, bs, inv_bs)
    if kind == DEC_QSGD:
        val = _mul(np.float32(code - s), scales[b] / np.float32(s))
    elif kind == DEC_TWO_MEAN:
        if code:
            val = scales[2 * b]
        else:
            val = scales[2 * b + 1]
    else:
        val = scales[b]
        if not code:
            val = -val
    if status[0] != 0:
        val = FNAN
    if accumulate:
        out[i] = out[i] + val
    else:
        out[i] = val


@cuda.jit
def _k_header(payload, header):
    tid = cuda.threadIdx.x
    if tid < 64:
        payload[tid] = (header[tid >> 3] >> (U8 * np.uint64(tid & 7))) & UFF


@cuda.jit(device=True)
def _fnv(payload, a, b, h):
    for k in range(a, b):
        h = ((h ^ np.uint64(payload[k])) * np.uint64(0x01000193)) & np.uint64(0xFFFFFFFF)
    return h


@cuda.jit(device=True)
def _hdr_err(payload, expect, check_name):
    """``_k_check``'s error bits for one payload header (one thread)."""
    err = 0
    if payload[0] != 72 or payload[1] != 86 or payload[2] != 68 or payload[3] != 81:   # b"HVDQ"
        err |= 1
    if payload[4] != wire.VERSION:
        err |= 2
    if payload[5] != expect[0]:
        err |= 4
    if payload[6] != expect[1]:
        err |= 8
    if payload[7] != expect[2]:
        err |= 16
    if payload[8] != expect[3]:
        err |= 32
    bsz = 0
    for k in range(4):
        bsz |= np.int64(payload[12 + k]) << (8 * k)
    if bsz != expect[4]:
        err |= 64
    n = np.uint64(0)
    for k in range(8):
        n |= np.uint64(payload[16 + k]) << (U8 * np.uint64(k))
    if n != np.uint64(expect[5]):
        err |= 128
    if check_name:
        nh = 0
        for k in range(4):
            nh |= np.int64(payload[56 + k]) << (8 * k)
        if nh != expect[6]:
            err |= 256
    h = _fnv(payload, 0, 62, np.uint64(0x811C9DC5))
    h = ((h >> np.uint64(16)) ^ h) & np.uint64(0xFFFF)
    if h != (np.uint64(payload[62]) | (np.uint64(payload[63]) << U8)):
        err |= 512
    h = _fnv(payload, 4, 9, np.uint64(0x811C9DC5))
    h = _fnv(payload, 12, 16, h)
    h = ((h >> np.uint64(16)) ^ h) & np.uint64(0xFFFF)
    if h != (np.uint64(payload[60]) | (np.uint64(payload[61]) << U8)):
        err |= 1024
    return err


@cuda.jit(device=True)
def _block_bad(payload, status, expect, check, check_name, serr):
    """Whether this block decodes a bad payload: thread 0 runs the header check (``check``; block 0
    also stores the error bits in ``status``, as ``_k_check`` does) or reads ``status[0]``; ``serr`` is
    a shared int32[1]. Every thread of the block must call it (it ends with a block barrier)."""
    if cuda.threadIdx.x == 0:
        if check:
            err = _hdr_err(payload, expect, check_name)
            if cuda.blockIdx.x == 0:
                status[0] = err
                status[1] = status[1] | err
        else:
            err = status[0]
        serr[0] = err
    cuda.syncthreads()
    return serr[0] != 0


@cuda.jit
def _k_check(payload, status, expect, check_name):
    if cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x != 0:
        return
    err = _hdr_err(payload, expect, check_name)
    status[0] = err
    status[1] = status[1] | err


kernels = {"reduce": _k_reduce, "pack": _k_pack, "decode": _k_decode, "header": _k_header,
           "check": _k_check}


# ---- launchers --------------------------------------------------------------------------------------

def _grid(n, per):
    return (n + per - 1) // per


def _words(header):
    if type(header) is tuple and len(header) == 8 and all(type(w) is np.uint64 for w in header):
        return header
    return tuple(np.uint64(int(w)) for w in header)


def _scales_view(payload, lay):
    # zero-length views are fine; a slice + view is two small host-side objects, no device work
    return payload[lay.scales_offset:lay.scales_offset + 4 * lay.nscales].view(np.float32)


def _check_size(payload, lay):
    if payload.size != lay.total:
        raise wire.PayloadError(f"payload has {payload.size} bytes, expected {lay.total} ({lay})")


_ZERO_STATUS = {}


def _zero_status():
    """A device int32[2] of zeros (per context), for decodes whose payload was checked on the host."""
    key = id(cuda.current_context()) if not SIMULATOR else 0
    st = _ZERO_STATUS.get(key)
    if st is None:
        st = _ZERO_STATUS[key] = cuda.to_device(np.zeros(2, np.int32))
    return st


def write_header_cuda(payload, header, stream=0):
    """Write the 64 header bytes (8 uint64 words, passed as a kernel argument: no host->device copy)."""
    _k_header[1, 64, stream or 0](payload, _words(header))


def check_header_cuda(payload, status, method, bits, mode, norm, bucket_size, numel, name_hash,
                      check_name, stream=0):
    """Validate a device payload's header against what the receiver expects, on the device.

    Writes the error bits into ``status[0]`` and ORs them into ``status[1]`` (int32 device array)."""
    expect = (int(method), int(bits), int(mode), int(norm), int(bucket_size), int(numel), int(name_hash))
    _k_check[1, 32, stream or 0](payload, status, expect, bool(check_name))


def qsgd_encode_cuda(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=0):
    """Bucketed QSGD encode of a float32 device array into a uint8 device payload (2 launches)."""
    n = x.size
    lay = wire.layout(wire.METHODS["qsgd"], n, bits, bucket_size)
    _check_size(payload, lay)
    stream = stream or 0
    scales = _scales_view(payload, lay)
    if n:
        per = BLOCK // 32
        _k_reduce[_grid(lay.nbuckets, per), BLOCK, stream](x, scales, n, int(bucket_size), lay.nbuckets,
                                                          L2 if norm_l2 else MAX)
    _k_pack[max(1, _grid(n, BLOCK)), BLOCK, stream](
        x, payload, scales, _words(header), n, lay.codes_offset, lay.codes_nbytes, lay.scales_offset,
        int(bits), int(bucket_size), 1.0 / bucket_size, PACK_STOCH if stochastic else PACK_DET,
        np.uint64(int(key)))


def qsgd_decode_cuda(payload, out, bits, bucket_size, accumulate, stream=0, status=None):
    """out (+)= dequantized QSGD payload; writes NaN when ``status[0] != 0`` (see ``check_header_cuda``)."""
    n = out.size
    lay = wire.layout(wire.METHODS["qsgd"], n, bits, bucket_size)
    _check_size(payload, lay)
    if n == 0:
        return
    _k_decode[_grid(n, BLOCK), BLOCK, stream or 0](
        payload, _scales_view(payload, lay), out, _zero_status() if status is None else status, n,
        lay.codes_offset, int(bits), int(bucket_size), 1.0 / bucket_size, DEC_QSGD, bool(accumulate))


def onebit_encode_cuda(x, payload, header, bucket_size, two_mean, stream=0):
    """1-bit encode. ``bucket_size`` 0 = one bucket per tensor (one 32-thread group reduces it all:
    slow for large tensors on a GPU; prefer a bucket size)."""
    n = x.size
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = wire.layout(wire.METHODS["onebit"], n, 1, bucket_size, mode)
    _check_size(payload, lay)
    stream = stream or 0
    bs = int(bucket_size) or max(n, 1)
    scales = _scales_view(payload, lay)
    if n:
        per = BLOCK // 32
        _k_reduce[_grid(lay.nbuckets, per), BLOCK, stream](x, scales, n, bs, lay.nbuckets,
                                                          TWO_MEAN if two_mean else MEAN_ABS)
    _k_pack[max(1, _grid(n, BLOCK)), BLOCK, stream](
        x, payload, scales, _words(header), n, lay.codes_offset, lay.codes_nbytes, lay.scales_offset,
        1, bs, 1.0 / bs, PACK_ONEBIT, np.uint64(0))


def onebit_decode_cuda(payload, out, bucket_size, two_mean, accumulate, stream=0, status=None):
    n = out.size
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = wire.layout(wire.METHODS["onebit"], n, 1, bucket_size, mode)
    _check_size(payload, lay)
    if n == 0:
        return
    bs = int(bucket_size) or max(n, 1)
    _k_decode[_grid(n, BLOCK), BLOCK, stream or 0](
        payload, _scales_view(payload, lay), out, _zero_status() if status is None else status, n,
        lay.codes_offset, 1, bs, 1.0 / bs, DEC_TWO_MEAN if two_mean else DEC_MEAN_ABS, bool(accumulate))


# =====================================================================================================
# v2: fused kernels and a cheaper launch path (the default; HVD_QUANT_CUDA_KERNELS=v1 selects the
# kernels and launchers above, unchanged).
#
# * ``_k2_encode_<bits>``: one launch per encode. A block owns G whole buckets (G*bs*bits a multiple
#   of 32, so its codes are whole 32-bit words). Phase 1: warp w computes the scales of buckets w,
#   w+NW, ... in the canonical order (lane l adds elements l, l+32, ... sequentially, then the
#   shared-memory tree 16..1), keeps scale and unit = scale/s in shared memory and writes the scales.
#   Phase 2: one thread per 32-bit word of codes: it quantizes the 32/bits elements of its word (x is
#   re-read from L1/L2, the block's buckets were just read) and writes the word with one 4-byte
#   store; the padding words come out zero. Block 0 also writes the header. ``bits`` is a
#   compile-time constant (one kernel per bit width, compiled on first use), so ``// bits`` and
#   ``% bits`` are multiplies and shifts. Buckets larger than FUSE_MAX (and onebit bucket_size=0)
#   use v1's reduce kernel, then this kernel in pack-only mode.
# * ``_k2_decode_<bits>``: one launch per decode, grid-stride over chunks of K*BLOCK elements: the
#   block first fills a shared table of unit = scale/s for the chunk's buckets (one IEEE division per
#   bucket, not per element), then thread t writes elements base + k*BLOCK + t (coalesced stores),
#   each read from the 32-bit code words. The header check (``_k_check``'s comparisons) runs in the
#   decode kernel: thread 0 of every block computes the error word once (block 0 also stores it in
#   ``status``); ``check_header_cuda`` defers its launch to the decode that follows it.
# * Launches: after a kernel's first (compiling) launch, its compiled ``_Kernel`` is launched directly
#   (``_Kernel.launch``: skips the per-call argument typing of ``kernel[grid, block, stream](...)``),
#   views of a payload (code words, scales) are cached per payload array.
# =====================================================================================================
import functools
import math
import os
import threading
import weakref

IMPLS = ("v1", "v2", "v3")
_IMPL = [os.environ.get("HVD_QUANT_CUDA_KERNELS", "v3").strip().lower() or "v3"]
if _IMPL[0] not in IMPLS:
    raise ValueError(f"HVD_QUANT_CUDA_KERNELS={_IMPL[0]!r}: expected one of {', '.join(IMPLS)}")


def impl():
    """The selected kernel implementation: 'v3' (default), 'v2' or 'v1' (env HVD_QUANT_CUDA_KERNELS)."""
    return _IMPL[0]


def set_impl(name):
    """Select 'v1', 'v2' or 'v3' for the launchers of this module (tests and benchmarks)."""
    name = str(name).lower()
    if name not in IMPLS:
        raise ValueError(f"unknown CUDA kernel implementation {name!r}; expected one of {', '.join(IMPLS)}")
    flush_pending()
    _IMPL[0] = name


# elements per block targeted by the fused encode; buckets above FUSE_MAX take the two-kernel path
_ENC_ELEMS = 256 if SIMULATOR else 4096
FUSE_MAX = 8192
_MAXG = 1024                        # buckets per encode block (shared memory: 3 floats per bucket)
_DEC_K = 2 if SIMULATOR else 8      # elements per thread per decode chunk
_DEC_CHUNK = _DEC_K * BLOCK
_DEC_TABLE = _DEC_CHUNK + 8         # units of the buckets one chunk touches (bs=1: one per element)
_WBITS = np.int64(32)
_M32 = np.int64(0xFFFFFFFF)




def _make_encode(BITS):
    S = (1 << (BITS - 1)) - 1
    SF = np.float32(S)
    PER = 32 // BITS + 2           # at most this many elements touch one 32-bit word

    @cuda.jit
    def k2_encode(x, payload, words, scales, header, n, nb, bs, inv_bs, G, red, pack, fused, key):
        tid = cuda.threadIdx.x
        blk = cuda.blockIdx.x
        nthr = cuda.blockDim.x
        lane = tid % 32
        warp = tid // 32
        nw = nthr // 32
        sp = cuda.shared.array(_SHARED, float32)
        sq = cuda.shared.array(_SHARED, float32)
        sc = cuda.shared.array(_SHARED, int64)
        ssc = cuda.shared.array(_MAXG, float32)
        sunit = cuda.shared.array(_MAXG, float32)
        b0 = np.int64(blk) * G
        b1 = min(nb, b0 + G)
        nbl = b1 - b0
        if nbl < 0:
            nbl = 0
        if fused:
            # phase 1: the scales of this block's buckets; every warp runs the same number of rounds
            rounds = (nbl + nw - 1) // nw
            for rd in range(rounds):
                lb = rd * nw + warp
                p = F0
                q = F0
                cnt = 0
                st = (b0 + lb) * bs
                en = min(n, st + bs)
                if lb < nbl:
                    i = st + lane
                    while i < en:
                        p, q, cnt = _add_term(red, x[i], p, q, cnt)
                        i += 32
                sp[tid] = p
                sq[tid] = q
                sc[tid] = cnt
                cuda.syncthreads()
                stride = 16
                while stride > 0:
                    if lane < stride:
                        if red == MAX:
                            sp[tid] = _max_nan(sp[tid], sp[tid + stride])
                        else:
                            sp[tid] = sp[tid] + sp[tid + stride]
                            sq[tid] = sq[tid] + sq[tid + stride]
                            sc[tid] = sc[tid] + sc[tid + stride]
                    cuda.syncthreads()
                    stride //= 2
                if lane == 0 and lb < nbl:
                    b = b0 + lb
                    p = sp[tid]
                    if red == MAX:
                        scales[b] = p
                        ssc[lb] = p
                        sunit[lb] = p / SF
                    elif red == L2:
                        p = _sqrt32(p)
                        scales[b] = p
                        ssc[lb] = p
                        sunit[lb] = p / SF
                    elif red == TWO_MEAN:
                        npos = sc[tid]
                        nneg = (en - st) - npos
                        mp = F0
                        mn = F0
                        if npos > 0:
                            mp = p / np.float32(npos)
                        if nneg > 0:
                            mn = sq[tid] / np.float32(nneg)
                        if not (_finite(mp) and _finite(mn)):
                            mp = FNAN
                            mn = FNAN
                        scales[2 * b] = mp
                        scales[2 * b + 1] = mn
                    else:
                        scales[b] = p / np.float32(en - st)
                cuda.syncthreads()     # the next round reuses sp/sq/sc; phase 2 reads ssc/sunit
        # phase 2: 32-bit code words [w0, w1) of this block (the last block also writes the padding)
        if fused:
            w0 = (b0 * bs * BITS) // 32
            if b1 >= nb:
                w1 = np.int64(words.size)
            else:
                w1 = (b1 * bs * BITS) // 32
        else:
            w0 = b0 * G
            w1 = min(np.int64(words.size), w0 + G)
        w = w0 + tid
        while w < w1:
            bit0 = w * 32
            e = bit0 // BITS
            e_end = min(n, (bit0 + 32 + BITS - 1) // BITS)
            acc = np.int64(0)
            if e < e_end:
                if pack == PACK_ONEBIT:
                    while e < e_end:
                        if x[e] >= F0:
                            acc |= np.int64(1) << (e - bit0)
                        e += 1
                else:
                    b = _bucket_of(e, bs, inv_bs)
                    bend = (b + 1) * bs
                    if fused:
                        scale = ssc[b - b0]
                        unit = sunit[b - b0]
                    else:
                        scale = scales[b]
                        unit = scale / SF
                    for _ in range(PER):
                        if e < e_end:
                            if e >= bend:
                                b += 1
                                bend += bs
                                if fused:
                                    scale = ssc[b - b0]
                                    unit = sunit[b - b0]
                                else:
                                    scale = scales[b]
                                    unit = scale / SF
                            c = _qsgd_code(x[e], scale, unit, SF, S, pack == PACK_STOCH, key, e)
                            sh = e * BITS - bit0
                            if sh >= 0:
                                acc |= c << sh
                            else:
                                acc |= c >> (-sh)
                            e += 1
            words[w] = np.uint32(acc & _M32)
            w += nthr
        if blk == 0 and tid < 64:
            payload[tid] = (header[tid >> 3] >> (U8 * np.uint64(tid & 7))) & UFF

    return k2_encode


def _make_decode(BITS):
    S = (1 << (BITS - 1)) - 1
    SF = np.float32(S)
    MASK = np.int64((1 << BITS) - 1)

    @cuda.jit
    def k2_decode(payload, words, scales, out, status, expect, check, check_name, n, bs, inv_bs, kind,
                  accumulate, nchunks):
        tid = cuda.threadIdx.x
        nthr = cuda.blockDim.x
        serr = cuda.shared.array(1, int32)
        sunit = cuda.shared.array(_DEC_TABLE, float32)
        bad = _block_bad(payload, status, expect, check, check_name, serr)
        chunk = np.int64(cuda.blockIdx.x)
        per = np.int64(nthr) * _DEC_K
        while chunk < nchunks:
            base = chunk * per
            last = min(n, base + per) - 1
            bl0 = _bucket_of(base, bs, inv_bs)
            if kind == DEC_QSGD:
                nbl = _bucket_of(last, bs, inv_bs) - bl0 + 1
                j = tid
                while j < nbl:
                    sunit[j] = scales[bl0 + j] / SF
                    j += nthr
                cuda.syncthreads()
            for k in range(_DEC_K):
                i = base + k * nthr + tid
                if i < n:
                    bitpos = i * BITS
                    wi = bitpos >> 5
                    sh = bitpos & 31
                    v = np.int64(words[wi]) >> sh
                    if sh + BITS > 32:
                        v |= np.int64(words[wi + 1]) << (32 - sh)
                    code = v & MASK
                    b = _bucket_of(i, bs, inv_bs)
                    if kind == DEC_QSGD:
                        val = _mul(np.float32(code - S), sunit[b - bl0])
                    elif kind == DEC_TWO_MEAN:
                        if code:
                            val = scales[2 * b]
                        else:
                            val = scales[2 * b + 1]
                    else:
                        val = scales[b]
                        if not code:
                            val = -val
                    if bad:
                        val = FNAN
                    if accumulate:
                        out[i] = out[i] + val
                    else:
                        out[i] = val
            if kind == DEC_QSGD:
                cuda.syncthreads()     # the next chunk overwrites the table
            chunk += cuda.gridDim.x

    return k2_decode


_KERNELS = {}
_kernels_lock = threading.Lock()


def _cached(name, make, spec):
    """The kernel ``make(spec)``, built once per (name, spec) and listed in ``kernels``."""
    key = f"{name}_{spec}" if not isinstance(spec, tuple) else name + "".join(f"_{v}" for v in spec)
    k = _KERNELS.get(key)
    if k is None:
        with _kernels_lock:
            k = _KERNELS.get(key)
            if k is None:
                k = _KERNELS[key] = kernels[key] = make(spec)
    return k


def _enc_kernel(bits):
    return _cached("v2_encode", _make_encode, bits)


def _dec_kernel(bits):
    return _cached("v2_decode", _make_decode, bits)


# ---- v2 launch path ---------------------------------------------------------------------------------

_FAST = (not SIMULATOR) and os.environ.get("HVD_QUANT_CUDA_FAST_LAUNCH", "1") != "0"
_COMPILED = {}          # id(dispatcher) -> its single compiled _Kernel


def _launch(disp, grid, block, stream, args):
    """``disp[grid, block, stream](*args)``; once the kernel has its (single) compiled overload, that
    overload is launched directly (``_Kernel.launch``), skipping the dispatcher's per-call typing.
    Every launcher passes arguments of fixed types, so the overload is the one these args select."""
    if _FAST:
        kern = _COMPILED.get(id(disp))
        if kern is not None:
            # The dispatcher accepts 0 for the default stream; a compiled kernel's launch (numba-cuda
            # on cuda.core) wants a stream object.
            kern.launch(args, (grid, 1, 1), (block, 1, 1), stream if stream else cuda.default_stream(), 0)
            return
    disp[grid, block, stream](*args)
    if _FAST:
        ovl = getattr(disp, "overloads", None)
        if ovl is not None and len(ovl) == 1:
            kern = next(iter(ovl.values()))
            if callable(getattr(kern, "launch", None)):
                _COMPILED[id(disp)] = kern


_NSM = []


def _sm_count():
    if not _NSM:
        if SIMULATOR:
            _NSM.append(2)
        else:
            try:
                _NSM.append(int(cuda.get_current_device().MULTIPROCESSOR_COUNT))
            except Exception:       # pragma: no cover
                _NSM.append(132)
    return _NSM[0]


_VIEWS = weakref.WeakKeyDictionary()


def _views(payload, lay):
    """(uint32 view of the code words incl. padding, float32 view of the scales), cached per payload
    array (device-array slicing and ``view`` are comparatively slow Python)."""
    key = (lay.codes_offset, lay.scales_offset, lay.nscales)
    try:
        hit = _VIEWS.get(payload)
    except TypeError:               # not weak-referenceable
        hit = None
    if hit is not None and hit[0] == key:
        return hit[1], hit[2]
    words = payload[lay.codes_offset:lay.scales_offset].view(np.uint32)
    scales = payload[lay.scales_offset:lay.scales_offset + 4 * lay.nscales].view(np.float32)
    try:
        _VIEWS[payload] = (key, words, scales)
    except TypeError:
        pass
    return words, scales


# deferred header checks: check_header_cuda for a kernel-decoded payload is run by the decode
_tls = threading.local()
_NO_CHECK = (0, 0, 0, 0, 0, 0, 0)


def flush_pending():
    """Launch a deferred header check now (a no-op when none is pending)."""
    pend = getattr(_tls, "pending", None)
    if pend is not None:
        _tls.pending = None
        payload, status, expect, check_name, stream = pend
        _launch(_k_check, 1, 32, stream, (payload, status, expect, check_name))


def _take_pending(payload, status, stream):
    """(expect, check_name) of the check deferred for exactly this payload/status/stream, else None
    (any other pending check is launched first)."""
    pend = getattr(_tls, "pending", None)
    if pend is None:
        return None
    if pend[0] is payload and pend[1] is status and pend[4] == stream:
        _tls.pending = None
        return pend[2], pend[3]
    flush_pending()
    return None


def _v2_write_header(payload, header, stream=0):
    flush_pending()
    _launch(_k_header, 1, 64, stream or 0, (payload, _words(header)))


def _v2_check_header(payload, status, method, bits, mode, norm, bucket_size, numel, name_hash,
                     check_name, stream=0):
    flush_pending()
    expect = (int(method), int(bits), int(mode), int(norm), int(bucket_size), int(numel), int(name_hash))
    stream = stream or 0
    # qsgd (not fake) and onebit payloads are decoded by a kernel right after the check (see
    # hvd_quant.codecs): that kernel runs the check; raw payloads are read by framework ops
    if (method == wire.METHODS["qsgd"] and mode != wire.MODES["fake"]) or method == wire.METHODS["onebit"]:
        _tls.pending = (payload, status, expect, bool(check_name), stream)
        return
    _launch(_k_check, 1, 32, stream, (payload, status, expect, bool(check_name)))


@functools.lru_cache(maxsize=4096)
def _layout(method, numel, bits, bucket_size, mode=0):
    """wire.layout, memoised (Layout objects are never modified)."""
    return wire.layout(method, numel, bits, bucket_size, mode)


_F32 = np.dtype(np.float32)


def _check_f32(a, what):
    """The v2 launchers launch a kernel's compiled overload directly: hold user arrays to the one
    signature it was compiled for (1-D contiguous float32), as the dispatcher would have by typing."""
    if a.dtype != _F32 or a.ndim != 1 or (a.size > 1 and a.strides[0] != 4):
        raise TypeError(f"{what} must be a contiguous 1-D float32 device array; got {a.dtype} "
                        f"shape {a.shape} strides {a.strides}")


@functools.lru_cache(maxsize=1024)
def _encode_groups(bs, bits):
    """Buckets per block G for the fused encode: G*bs*bits is a multiple of 32 (blocks own whole
    code words), G*bs about _ENC_ELEMS, G <= _MAXG."""
    g0 = 32 // math.gcd(bs * bits, 32)
    g = max(1, _ENC_ELEMS // bs)
    g = -(-g // g0) * g0
    return min(g, _MAXG // g0 * g0)


def _v2_encode(x, payload, header, bits, bs, red, pack, key, lay, stream):
    flush_pending()
    n = x.size
    words, scales = _views(payload, lay)
    nb = lay.nbuckets
    k = _enc_kernel(bits)
    hdr = _words(header)
    if bs <= FUSE_MAX:
        g = _encode_groups(bs, bits)
        _launch(k, max(1, _grid(nb, g)), BLOCK, stream,
                (x, payload, words, scales, hdr, n, nb, bs, 1.0 / bs, g, red, pack, True, key))
    else:
        if n:
            _launch(_k_reduce, _grid(nb, BLOCK // 32), BLOCK, stream, (x, scales, n, bs, nb, red))
        g = 2 * BLOCK                   # words per block in pack-only mode
        _launch(k, max(1, _grid(words.size, g)), BLOCK, stream,
                (x, payload, words, scales, hdr, n, nb, bs, 1.0 / bs, g, red, pack, False, key))


def _decode_check(payload, n, stream, status):
    """(expect, check, check_name) for a decode kernel, which takes over the header check deferred for
    exactly this payload (any other pending check is launched first); None when there is nothing to
    decode (the deferred check, if any, is then launched on its own: the status must be written)."""
    pend = _take_pending(payload, status, stream) if status is not None else None
    if pend is None:
        flush_pending()
    if n == 0:
        if pend is not None:
            _launch(_k_check, 1, 32, stream, (payload, status, pend[0], pend[1]))
        return None
    if pend is None:
        return _NO_CHECK, False, False
    return pend[0], True, pend[1]


def _v2_decode(payload, out, bits, bs, kind, accumulate, lay, stream, status):
    stream = stream or 0
    n = out.size
    chk = _decode_check(payload, n, stream, status)
    if chk is None:
        return
    expect, check, check_name = chk
    words, scales = _views(payload, lay)
    nchunks = _grid(n, _DEC_CHUNK)
    grid = min(nchunks, 8 * _sm_count())
    _launch(_dec_kernel(bits), grid, BLOCK, stream,
            (payload, words, scales, out, _zero_status() if status is None else status, expect, check,
             check_name, n, bs, 1.0 / bs, kind, bool(accumulate), nchunks))


# ---- v3: one warp per bucket (numba_kernels/_cuda_warp.py) ---------------------------------------

from types import SimpleNamespace as _NS  # noqa: E402

from . import _cuda_warp  # noqa: E402

_make_encode3, _make_decode3 = _cuda_warp.build(_NS(
    SIMULATOR=SIMULATOR, qsgd_code=_qsgd_code, max_nan=_max_nan, finite=_finite, mul=_mul,
    sqrt32=_sqrt32, add_term=_add_term, block_bad=_block_bad, qsgd_level=_ops.qsgd_level,
    qsgd_round=_ops.qsgd_round, uniform24=_ops.uniform24, draw=_ops.draw, mix64=_ops.mix64, MAX=MAX, L2=L2, TWO_MEAN=TWO_MEAN, PACK_STOCH=PACK_STOCH,
    PACK_ONEBIT=PACK_ONEBIT, DEC_QSGD=DEC_QSGD, DEC_TWO_MEAN=DEC_TWO_MEAN))

_RESIDENT = {}


def _resident_blocks(disp):
    """Blocks of ``disp``'s compiled kernel that fit on the GPU at once (its persistent grid size);
    4 per multiprocessor until the kernel is compiled (or where occupancy cannot be queried)."""
    r = _RESIDENT.get(id(disp))
    if r is None:
        r = 4 * _sm_count()
        kern = _COMPILED.get(id(disp))
        if kern is not None and not SIMULATOR:
            try:
                r = _RESIDENT[id(disp)] = max(1, int(kern.max_cooperative_grid_blocks(BLOCK)))
            except Exception:       # pragma: no cover - occupancy query unavailable
                r = _RESIDENT[id(disp)] = r
    return r


def _v3_supported(bits, bs, n):
    return _IMPL[0] == "v3" and _cuda_warp.supported(bits, bs, n, FUSE_MAX)


def _v3_encode(x, payload, header, bits, bs, red, pack, key, lay, stream):
    flush_pending()
    words, scales = _views(payload, lay)
    nb = lay.nbuckets
    ngroups = max(1, _grid(nb, BLOCK // 32))
    regk = _cuda_warp.regk(bs)
    paired = pack == PACK_STOCH and regk >= 2 and bs % 64 == 0
    _launch(_cached("v3_encode", _make_encode3, (bits, red, pack, regk, paired)), ngroups, BLOCK, stream,
            (x, payload, words, scales, _words(header), x.size, nb, bs, (bs + 31) // 32, ngroups, key))


def _v3_decode(payload, out, bits, bs, kind, accumulate, lay, stream, status):
    stream = stream or 0
    n = out.size
    chk = _decode_check(payload, n, stream, status)
    if chk is None:
        return
    expect, check, check_name = chk
    words, scales = _views(payload, lay)
    nb = lay.nbuckets
    ngroups = _grid(nb, BLOCK // 32)
    k = _cached("v3_decode", _make_decode3, (bits, kind, _cuda_warp.dec_steps(bs)))
    _launch(k, min(ngroups, _resident_blocks(k)), BLOCK, stream,
            (payload, words, scales, out, _zero_status() if status is None else status, expect, check,
             check_name, n, nb, bs, (bs + 31) // 32, ngroups, bool(accumulate)))


# ---- public launchers: dispatch on the selected implementation -------------------------------------

_v1_write_header = write_header_cuda
_v1_check_header = check_header_cuda
_v1_qsgd_encode = qsgd_encode_cuda
_v1_qsgd_decode = qsgd_decode_cuda
_v1_onebit_encode = onebit_encode_cuda
_v1_onebit_decode = onebit_decode_cuda


def write_header_cuda(payload, header, stream=0):  # noqa: F811
    """Write the 64 header bytes (8 uint64 words, passed as a kernel argument: no host->device copy)."""
    if _IMPL[0] == "v1":
        return _v1_write_header(payload, header, stream)
    return _v2_write_header(payload, header, stream)


def check_header_cuda(payload, status, method, bits, mode, norm, bucket_size, numel, name_hash,  # noqa: F811
                      check_name, stream=0):
    """Validate a device payload's header against what the receiver expects, on the device.

    Writes the error bits into ``status[0]`` and ORs them into ``status[1]`` (int32 device array).
    v2: for qsgd (not fake) and onebit the check is deferred to the decode launched next on the same
    payload, status and stream (one kernel instead of two); any other launch runs it first."""
    if _IMPL[0] == "v1":
        return _v1_check_header(payload, status, method, bits, mode, norm, bucket_size, numel,
                                name_hash, check_name, stream)
    return _v2_check_header(payload, status, method, bits, mode, norm, bucket_size, numel, name_hash,
                            check_name, stream)


def qsgd_encode_cuda(x, payload, header, bits, bucket_size, stochastic, norm_l2, key, stream=0):  # noqa: F811
    """Bucketed QSGD encode of a float32 device array into a uint8 device payload (one launch; v3 where
    ``_cuda_warp.supported``, else v2; buckets above FUSE_MAX take v1's two launches)."""
    bits, bs, n = int(bits), int(bucket_size), x.size
    if _IMPL[0] == "v1" or bs > FUSE_MAX:
        # Buckets larger than FUSE_MAX: v2's reduce-then-pack path did not match the reference on an
        # H100 (docs/BENCHMARKS.md); v1's encode did, and writes the same payload.
        flush_pending()
        return _v1_qsgd_encode(x, payload, header, bits, bs, stochastic, norm_l2, key, stream)
    _check_f32(x, "x")
    lay = _layout(wire.METHODS["qsgd"], n, bits, bs)
    _check_size(payload, lay)
    enc = _v3_encode if _v3_supported(bits, bs, n) else _v2_encode
    enc(x, payload, header, bits, bs, L2 if norm_l2 else MAX, PACK_STOCH if stochastic else PACK_DET,
        np.uint64(int(key)), lay, stream or 0)


def qsgd_decode_cuda(payload, out, bits, bucket_size, accumulate, stream=0, status=None):  # noqa: F811
    """out (+)= dequantized QSGD payload; writes NaN when ``status[0] != 0`` (see ``check_header_cuda``)."""
    if _IMPL[0] == "v1":
        return _v1_qsgd_decode(payload, out, bits, bucket_size, accumulate, stream, status)
    _check_f32(out, "out")
    bits, bs, n = int(bits), int(bucket_size), out.size
    lay = _layout(wire.METHODS["qsgd"], n, bits, bs)
    _check_size(payload, lay)
    dec = _v3_decode if _v3_supported(bits, bs, n) else _v2_decode
    dec(payload, out, bits, bs, DEC_QSGD, accumulate, lay, stream, status)


def onebit_encode_cuda(x, payload, header, bucket_size, two_mean, stream=0):  # noqa: F811
    """1-bit encode (one launch when the bucket size is at most FUSE_MAX, else v1's two launches)."""
    n = x.size
    if _IMPL[0] == "v1" or (int(bucket_size) or max(n, 1)) > FUSE_MAX:
        flush_pending()         # see qsgd_encode_cuda: large buckets take v1's encode
        return _v1_onebit_encode(x, payload, header, bucket_size, two_mean, stream)
    _check_f32(x, "x")
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = _layout(wire.METHODS["onebit"], n, 1, int(bucket_size), mode)
    _check_size(payload, lay)
    bs = int(bucket_size) or max(n, 1)
    enc = _v3_encode if _v3_supported(1, bs, n) else _v2_encode
    enc(x, payload, header, 1, bs, TWO_MEAN if two_mean else MEAN_ABS, PACK_ONEBIT, np.uint64(0), lay,
        stream or 0)


def onebit_decode_cuda(payload, out, bucket_size, two_mean, accumulate, stream=0, status=None):  # noqa: F811
    if _IMPL[0] == "v1":
        return _v1_onebit_decode(payload, out, bucket_size, two_mean, accumulate, stream, status)
    _check_f32(out, "out")
    n = out.size
    mode = wire.ONEBIT_SCALES["two_mean" if two_mean else "mean_abs"]
    lay = _layout(wire.METHODS["onebit"], n, 1, int(bucket_size), mode)
    _check_size(payload, lay)
    bs = int(bucket_size) or max(n, 1)
    dec = _v3_decode if _v3_supported(1, bs, n) else _v2_decode
    dec(payload, out, 1, bs, DEC_TWO_MEAN if two_mean else DEC_MEAN_ABS, accumulate, lay, stream, status)


# ---- explicit expectations (interim: the decode takes the header it expects) -------------------------
_check_fields = check_header_cuda
_qsgd_decode_impl = qsgd_decode_cuda
_onebit_decode_impl = onebit_decode_cuda


def check_header_cuda(payload, status, expect, *fields):  # noqa: F811
    """Validate a device payload's header against ``expect`` (a ``wire.Expect``) on the device."""
    if isinstance(expect, wire.Expect):
        return _check_fields(payload, status, *expect, *fields)
    return _check_fields(payload, status, expect, *fields)


def qsgd_decode_cuda(payload, out, bits, bucket_size, accumulate, stream=0, status=None, expect=None):  # noqa: F811
    if expect is not None:
        _check_fields(payload, status, *expect, stream)
    _qsgd_decode_impl(payload, out, bits, bucket_size, accumulate, stream, status)


def onebit_decode_cuda(payload, out, bucket_size, two_mean, accumulate, stream=0, status=None,  # noqa: F811
                       expect=None):
    if expect is not None:
        _check_fields(payload, status, *expect, stream)
    _onebit_decode_impl(payload, out, bucket_size, two_mean, accumulate, stream, status)
