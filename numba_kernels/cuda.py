"""Numba CUDA kernels (``*_cuda``), bit-identical to ``*_ref``; they also run in the CUDA simulator.

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
           "write_header_cuda", "check_header_cuda", "kernels", "SIMULATOR", "BLOCK"]

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
            v = x[i]
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


@cuda.jit
def _k_check(payload, status, expect, check_name):
    if cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x != 0:
        return
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
