"""Device functions and constants of the CUDA kernels, imported via ``numba_kernels.cuda`` (its doc says why lazily)."""
import numba
import numpy as np
from numba import cuda
from numba import types as nbt

from ._scalar import F0, U8, UFF, build

SIMULATOR = bool(numba.config.ENABLE_CUDASIM)
# Threads per block. 256 on hardware; the simulator runs a Python thread per CUDA thread, so smaller.
BLOCK = 64 if SIMULATOR else 256
SHARED = 256            # shared arrays are sized for the largest block

if SIMULATOR:
    def _fmul_impl(a, b):
        return a * b
else:
    from numba.cuda import libdevice

    def _fmul_impl(a, b):
        return libdevice.fmul_rn(a, b)

fmul = cuda.jit(device=True)(_fmul_impl)
_ops = build(cuda.jit(device=True), fmul)
# _scalar's math compiled for the device, under the names the kernels import
(bucket_of, draw, header_errors, kmeans_draw, kmeans_fixed, kmeans_index, kmeans_mean, kmeans_mids,
 kmeans_scale, kmeans_starts, max_nan, mix64, mul, onebit_scales, qsgd_code, qsgd_level, qsgd_round,
 sortquant_level, sortquant_value, sqrt32, uniform24) = (getattr(_ops, name) for name in (
    "bucket_of draw header_errors kmeans_draw kmeans_fixed kmeans_index kmeans_mean kmeans_mids kmeans_scale "
    "kmeans_starts max_nan mix64 mul onebit_scales qsgd_code qsgd_level qsgd_round sortquant_level "
    "sortquant_value sqrt32 uniform24").split())

# reductions (scales)
MAX, L2, TWO_MEAN, MEAN_ABS = 0, 1, 2, 3
# code kinds of an encode
PACK_DET, PACK_STOCH, PACK_ONEBIT = 0, 1, 2
# decode kinds
DEC_QSGD, DEC_TWO_MEAN, DEC_MEAN_ABS = 0, 1, 2


def code_levels(bits):
    """QSGD's level count s for ``bits`` (0 for 1 bit), and s as a float32 divisor (at least 1)."""
    s = (1 << (bits - 1)) - 1 if bits > 1 else 0
    return s, np.float32(max(s, 1))


@cuda.jit(device=True)
def add_term(kind, v, p, q, cnt):
    """One element ``v`` added to a lane's running reduction of kind ``kind`` (p: max, sum of squares,
    sum of the non-negatives or sum of |v|; q: sum of the negatives; cnt: count of the non-negatives).
    Lanes add their elements in order: the canonical summation order (``numba_kernels.reference``)."""
    if kind == MAX:
        p = max_nan(p, abs(v))
    elif kind == L2:
        p = p + mul(v, v)
    elif kind == TWO_MEAN:
        if v >= F0:
            p = p + v
            cnt += 1
        else:
            q = q + v
    else:
        p = p + abs(v)
    return p, q, cnt


@cuda.jit(device=True)
def hdr_err(payload, expect, check_name):
    """Error bits of a payload header against ``expect`` (method, bits, mode, param, bucket_size, numel,
    name_hash): ``reference.header_errors_ref``."""
    return header_errors(payload, expect[0], expect[1], expect[2], expect[3], expect[4], expect[5],
                         expect[6], check_name)


@cuda.jit(device=True)
def publish(status, check, err, serr):
    """Thread 0's error bits into the shared ``serr[0]``: with ``check`` ``err`` (block 0 also stores
    it in ``status[0]`` and ORs it into ``status[1]``, as the check kernel does), else ``status[0]``."""
    if check:
        if cuda.blockIdx.x == 0:
            status[0] = err
            status[1] = status[1] | err
    else:
        err = status[0]
    serr[0] = err


@cuda.jit(device=True)
def block_bad(payload, status, expect, check, check_name, serr):
    """Whether this block decodes a bad payload (thread 0 checks its header, :func:`publish`). Every
    thread of the block must call it (it ends with a block barrier)."""
    if cuda.threadIdx.x == 0:
        err = 0
        if check:
            err = hdr_err(payload, expect, check_name)
        publish(status, check, err, serr)
    cuda.syncthreads()
    return serr[0] != 0


@cuda.jit(device=True, inline="always")
def put(out, i, val, accumulate):
    """``out[i] = val``, or ``out[i] += val`` with ``accumulate``."""
    if accumulate:
        out[i] = out[i] + val
    else:
        out[i] = val


@cuda.jit(device=True)
def header_byte(header, k):
    """Byte ``k`` (0..63) of the header words ``header`` (8 uint64)."""
    return (header[k >> 3] >> (U8 * np.uint64(k & 7))) & UFF


# ---- the kernels' launch signatures (1-D C-contiguous arrays; numba_kernels.cuda binds them once) ----

_F32 = nbt.Array(nbt.float32, 1, "C")
_U8 = nbt.Array(nbt.uint8, 1, "C")
_U32 = nbt.Array(nbt.uint32, 1, "C")
_I32 = nbt.Array(nbt.int32, 1, "C")
_HDR = nbt.UniTuple(nbt.uint64, 8)
_EXP = nbt.UniTuple(nbt.int64, 7)
_I64, _F64, _B1, _U64 = nbt.int64, nbt.float64, nbt.boolean, nbt.uint64

# the payloads a reduce_requantize sums (ignored by the plain encode): ppay, pwords, pscales, status,
# expect, check, check_name, npay, words per payload, scales offset in words, rin, has_rin
_SRC = (_U8, _U32, _F32, _I32, _EXP, _B1, _B1, _I64, _I64, _I64, _F32, _B1)
SIG_WARP_ENCODE = (_F32, _U8, _U32, _F32, _HDR, _I64, _I64, _I64, _I64, _I64, _U64, _F32) + _SRC
# ... accumulate, then the multi-payload decodes' (ignored by the plain decode): name_hashes, npay,
# words per payload, scales offset in words, buckets per chunk, the last chunk's scales offset
SIG_WARP_DECODE = (_U8, _U32, _F32, _F32, _I32, _EXP, _B1, _B1, _I64, _I64, _I64, _I64, _I64, _B1,
                   _U32, _I64, _I64, _I64, _I64, _I64)
SIG_BLOCK_ENCODE = (_F32, _U8, _U32, _F32, _HDR, _I64, _I64, _I64, _F64, _I64, _B1, _U64, _F32) + _SRC
SIG_REDUCE = (_F32, _F32, _I64, _I64, _I64) + _SRC
SIG_BLOCK_DECODE = (_U8, _U32, _F32, _F32, _I32, _EXP, _B1, _B1, _I64, _I64, _F64, _B1, _I64)
SIG_DECODE_MULTI = (_U8, _U32, _F32, _F32, _I32, _EXP, _B1, _B1, _U32, _I64, _I64, _F64, _I64, _I64,
                    _I64, _I64, _I64, _I64, _I64)
