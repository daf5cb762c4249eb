"""The CUDA kernels of KMeans (launched from ``numba_kernels.cuda``), equal to
``numba_kernels.reference.kmeans_*_ref`` bit for bit.

An encode is ``iters + 5`` launches after the header's; block k of the element-wise ones takes tile
``k % tpb`` (TILE elements) of bucket ``k // tpb`` and sums its share in shared memory before one
atomic add per centroid:

* ``k_clear``: the buckets' maxima and step 1's sums reset.
* ``k_stats``: each bucket's largest |x| as float32 bits (``amax >= 0x7F800000``: a non-finite bucket,
  which decodes to NaN), its min and its max.
* ``k_start``: a block per bucket sorts its sample (``sort_pairs``); one thread picks the starting
  centroids (``_scalar.kmeans_starts``) into ``cent[0]``.
* ``k_step`` (t = 1 .. iters): each block works out the centroids c(t-1) from step t - 1's sums (tile 0
  also stores them in ``cent[(t-1) % 2]`` for a centroid that loses its members), assigns its elements
  and adds their fixed-point values and counts into step t's sums (integers: the order of the atomic
  adds cannot change them), through 256 / K copies per centroid in shared memory. Step t adds into
  sums ``t % 3``, reads ``(t - 1) % 3`` and clears ``(t + 1) % 3``. ``final``: the codebook c(iters),
  each element's index into a uint16 scratch (packed by ``_cuda_sortquant.k_pack``), the residual.

The device runs every step; the CPU kernel stops once the centroids stop moving (the remaining steps
would repeat them exactly), so both give the same payload.
"""
import numpy as np
from numba import cuda, float32, float64, int32, int64

from ._cuda_device import (SHARED, kmeans_draw, kmeans_fixed, kmeans_index, kmeans_mean, kmeans_mids,
                           kmeans_scale, kmeans_starts, mix64, put)
from ._cuda_sortquant import sort_pairs
from ._scalar import F0, FINF, FNAN, KMEANS_SAMPLE

TILE = 4096             # elements per block of the element-wise kernels
NONFINITE = np.uint32(0x7F800000)
ABS = np.uint32(0x7FFFFFFF)


@cuda.jit
def k_clear(amax, lo, hi, total, count):
    i = cuda.grid(1)
    while i < total.shape[1]:
        total[1, i] = 0
        count[1, i] = 0
        if i < amax.size:
            amax[i] = 0
            lo[i] = FINF
            hi[i] = -FINF
        i += cuda.gridDim.x * cuda.blockDim.x


@cuda.jit
def k_stats(x, xu, amax, lo, hi, bs, tpb):
    """Per bucket b: amax[b] = the largest |x| bits (x as uint32 ``xu``), lo[b] / hi[b] its min / max."""
    ra = cuda.shared.array(SHARED, np.uint32)
    rl = cuda.shared.array(SHARED, float32)
    rh = cuda.shared.array(SHARED, float32)
    b = cuda.blockIdx.x // tpb
    st = b * bs + (cuda.blockIdx.x % tpb) * TILE
    en = min(st + TILE, b * bs + bs, xu.size)
    tid = cuda.threadIdx.x
    a = np.uint32(0)
    mn = FINF
    mx = -FINF
    for i in range(st + tid, en, cuda.blockDim.x):
        a = max(a, xu[i] & ABS)
        mn = min(mn, x[i])
        mx = max(mx, x[i])
    ra[tid] = a
    rl[tid] = mn
    rh[tid] = mx
    cuda.syncthreads()
    s = cuda.blockDim.x >> 1
    while s > 0:
        if tid < s:
            ra[tid] = max(ra[tid], ra[tid + s])
            rl[tid] = min(rl[tid], rl[tid + s])
            rh[tid] = max(rh[tid], rh[tid + s])
        cuda.syncthreads()
        s >>= 1
    if tid == 0:
        cuda.atomic.max(amax, b, ra[0])
        cuda.atomic.min(lo, b, rl[0])
        cuda.atomic.max(hi, b, rh[0])


@cuda.jit
def k_start(x, cent, amax, lo, hi, bs, K, key):
    """Block b: the starting centroids of bucket b (``_kmeans_bucket`` in the reference)."""
    key = mix64(key)                # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
    smp = cuda.shared.array(KMEANS_SAMPLE, float32)
    sidx = cuda.shared.array(KMEANS_SAMPLE, int32)
    comp = cuda.shared.array(KMEANS_SAMPLE, float64)
    b = cuda.blockIdx.x
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    st = b * bs
    n = min(bs, x.size - st)
    m = min(n, KMEANS_SAMPLE)
    P = 1
    while P < m:
        P <<= 1
    for p in range(tid, P, T):
        if p >= m:
            smp[p] = FINF
        elif n <= KMEANS_SAMPLE:
            smp[p] = x[st + p] + F0
        elif p == m - 2:
            smp[p] = lo[b] + F0
        elif p == m - 1:
            smp[p] = hi[b] + F0
        else:
            smp[p] = x[st + int64(kmeans_draw(key, b * KMEANS_SAMPLE + p) % np.uint64(n))] + F0
        sidx[p] = p
    cuda.syncthreads()
    sort_pairs(smp, sidx, P, tid, T)       # (equal values are equal bits here: the order of ties is moot)
    if tid == 0 and amax[b] < NONFINITE:     # (a NaN bucket's sample does not sort; it decodes to NaN)
        kmeans_starts(smp, m, comp, cent[0, b * K:(b + 1) * K], K)


@cuda.jit
def k_step(x, cent, amax, total, count, bs, tpb, K, t, final, book, codes, residual, has_res):
    """Lloyd step t (see the module docstring); ``final``: the codes and codebook of c(t-1)."""
    sc = cuda.shared.array(SHARED, float32)
    smid = cuda.shared.array(SHARED, float32)
    stot = cuda.shared.array(SHARED, int64)
    scnt = cuda.shared.array(SHARED, int64)
    b = cuda.blockIdx.x // tpb
    tile = cuda.blockIdx.x % tpb
    st = b * bs + tile * TILE
    en = min(st + TILE, b * bs + bs, x.size)
    tid = cuda.threadIdx.x
    T = cuda.blockDim.x
    ab = amax[b]
    bad = ab >= NONFINITE
    scale = kmeans_scale(ab)
    prev = (t - 1) % 3
    for j in range(tid, K, T):
        k = b * K + j
        if t == 1:
            c = cent[0, k]
        else:
            n = count[prev, k]
            c = kmeans_mean(total[prev, k], n, scale) if n > 0 else cent[t % 2, k]
            if tile == 0:
                cent[(t - 1) % 2, k] = c
        if bad:
            c = FNAN
        sc[j] = c
        if final:
            if tile == 0:
                book[k] = c
        elif tile == 0:
            total[(t + 1) % 3, k] = 0
            count[(t + 1) % 3, k] = 0
    for j in range(tid, SHARED, T):
        stot[j] = 0
        scnt[j] = 0
    cuda.syncthreads()
    if tid == 0:
        kmeans_mids(sc[:K], smid)
    cuda.syncthreads()
    if final:
        for i in range(st + tid, en, T):
            xv = x[i]
            q = 0 if bad else kmeans_index(smid, K, xv)
            codes[i] = np.uint16(q)
            if has_res:
                residual[i] = xv - sc[q]
        return
    copies = SHARED // K        # each thread adds into copy tid % copies: fewer threads per address
    slot = (tid % copies) * K
    for i in range(st + tid, en, T):
        xv = x[i]
        q = 0 if bad else kmeans_index(smid, K, xv)
        cuda.atomic.add(stot, slot + q, kmeans_fixed(xv, scale))
        cuda.atomic.add(scnt, slot + q, 1)
    cuda.syncthreads()
    for j in range(tid, K, T):
        tot = stot[j]
        cnt = scnt[j]
        for k in range(1, copies):
            tot += stot[k * K + j]
            cnt += scnt[k * K + j]
        if cnt > 0:
            cuda.atomic.add(total, (t % 3, b * K + j), tot)
            cuda.atomic.add(count, (t % 3, b * K + j), cnt)


@cuda.jit
def k_decode(payload, book, out, codes_off, bs, bits, accumulate, status, check):
    """out[i] (+)= the codebook entry of element i's code; NaN where ``check`` and ``status[0] != 0``."""
    bad = check and status[0] != 0
    K = 1 << bits
    mask = K - 1
    i = cuda.grid(1)
    while i < out.size:
        bp = i * bits
        o = codes_off + (bp >> 3)
        w = np.int32(payload[o])
        if (bp & 7) + bits > 8:
            w |= np.int32(payload[o + 1]) << 8
        v = FNAN if bad else book[(i // bs) * K + ((w >> (bp & 7)) & mask)]
        put(out, i, v, accumulate)
        i += cuda.gridDim.x * cuda.blockDim.x
