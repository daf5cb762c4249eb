"""The warp CUDA kernels: one warp per bucket where ``supported`` (else ``_cuda_block``). Lane ``l``
of bucket ``b``'s warp handles its elements ``l, l+32, ...``: the canonical order of every sum
(``numba_kernels.reference``) and coalesced 128-byte accesses.

* encode (``make_encode``): buckets of up to 512 elements are held in registers (``regk`` steps of 32
  per lane; larger buckets are read twice). Pass 1 reduces the bucket with shuffles (max: a xor
  butterfly; sums: ``shfl_down`` at strides 16..1, the canonical tree, then a broadcast). Pass 2
  quantizes, ``|x| / unit`` through the bucket's reciprocal where DIV_* allow it (``_scalar``),
  stochastic draws shared by pairs of steps. A 32-bit word holds the codes of ``32 // bits`` lanes of
  one step: where a lane holds that many steps, a recursive halving over the word's lanes leaves each
  lane one whole word, else a xor butterfly (1 bit: a ``ballot``) ORs each step's codes; words are
  stored after the loop. No shared memory, no barrier (on hardware). ``resid``: each lane writes the
  residuals of the elements it read (``residual`` may be ``x``); ``src`` (reduce_requantize): each
  element is the payloads' sum plus ``rin`` (``_cuda_block.make_load``), NaN when a payload is bad.
* decode (``make_decode``): a bucket's code words are read coalesced, each step takes its word from
  its lane with one shuffle and stores ``(code - s) * unit`` unconditionally (partial last steps and
  buckets above 512 elements read a word per element). The header check runs once per block, so the
  grid is persistent. Multi-payload modes: MULTI_SUM (n payloads summed in payload order, a bucket's
  sums in registers) and MULTI_CHUNKS (each bucket from its chunk's payload).

The CUDA simulator has no warp shuffles, fma or directed rounding: its shuffles go through shared
memory and block barriers (``bf``/``bi``: float32/int64 slots), so every loop's trip count is uniform
over the block (warps past the last bucket run with no element); fma and fmul_rd are computed exactly.
"""
from fractions import Fraction

import numpy as np
from numba import cuda, float32, int32, int64, uint32

from ._cuda_block import (HDR_WORDS, MAXCH, MULTI_CHUNKS, MULTI_SUM, PLAIN, chunks_bad, dec_kind,
                          make_load, make_value, multi_bad)
from ._cuda_device import (DEC_QSGD, DEC_TWO_MEAN, L2, MAX, PACK_ONEBIT, PACK_STOCH, SHARED, SIMULATOR,
                           TWO_MEAN, add_term, block_bad, draw, header_byte, code_levels, max_nan, mix64, mul,
                           onebit_scales, put, qsgd_code, qsgd_level, qsgd_round, sqrt32, uniform24)
from ._scalar import DIV_2M50, DIV_2M100, DIV_POS, DIV_UNIT_MAX, DIV_UNIT_MIN, F0, FINF, FNAN, GAMMA

SIMBUF = 256                       # shared slots for the simulator's shuffle emulation
FULL = 0xFFFFFFFF
ENC_REGS = 40                      # register caps per thread (see _limit)
ENC_REGS_1BIT = 48                 # (1 bit, two_mean: 40 would spill)
DEC_REGS = 40
DEC_REGS_MULTI = 64               # (a bucket's sums in registers)
M32 = np.int64(0xFFFFFFFF)


def regk(bucket_size):
    """Steps per lane fixed at compile time for this bucket size (the smallest power of two covering
    ``ceil(bucket_size / 32)``), or 0 (a run-time loop) above 16 steps."""
    r = 1 << (-(-bucket_size // 32) - 1).bit_length()
    return r if r <= 16 else 0


def dec_steps(bucket_size):
    """The decode's steps per bucket fixed at compile time: ``ceil(bucket_size / 32)`` up to 16, else 0."""
    steps = -(-bucket_size // 32)
    return steps if steps <= 16 else 0


def supported(bits, bucket_size, numel, fuse_max):
    """Whether the warp kernels handle this configuration (else the caller uses the general ones)."""
    if 32 % bits or numel >= 2 ** 31:
        return False
    return 32 <= bucket_size <= fuse_max and bucket_size % (32 // bits) == 0


if SIMULATOR:
    def _round_exact(exact, down=False):
        """The float32 nearest the Fraction ``exact`` (ties to even), or the largest float32 <= it."""
        f = np.float32(float(exact))               # within one float32 step of the exact value
        cands = [c for c in (np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf)))
                 if np.isfinite(c)]
        if down:
            return max(c for c in cands if Fraction(float(c)) <= exact)
        return min(cands, key=lambda c: (abs(Fraction(float(c)) - exact), int(c.view(np.uint32)) & 1))

    @cuda.jit(device=True)
    def fma(a, b, c):
        a, b, c = np.float32(a), np.float32(b), np.float32(c)
        if not (np.isfinite(a) and np.isfinite(b) and np.isfinite(c)):
            with np.errstate(all="ignore"):
                return np.float32(a * b + c)
        return _round_exact(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c)))

    @cuda.jit(device=True)
    def mul_rd(a, b):                              # (finite operands)
        return _round_exact(Fraction(float(np.float32(a))) * Fraction(float(np.float32(b))), down=True)

    def _ex(buf, v, src, tid):
        buf[tid] = v
        cuda.syncthreads()
        r = buf[src]
        cuda.syncthreads()
        return r

    def _pair(source):      # source(tid, m): the thread whose value thread tid receives
        @cuda.jit(device=True)
        def f(v, m, bf, bi, tid):
            return _ex(bf, v, source(tid, m), tid)

        @cuda.jit(device=True)
        def i(v, m, bf, bi, tid):
            return _ex(bi, v, source(tid, m), tid)

        return f, i

    xor_f, xor_i = _pair(lambda tid, m: tid ^ m)
    down_f, down_i = _pair(lambda tid, d: tid + d if tid % 32 + d < 32 else tid)
    bcast_f, bcast_i = _pair(lambda tid, src: tid - tid % 32 + src)

    @cuda.jit(device=True)
    def ballot(pred, bf, bi, tid):
        w = np.int64(1) << np.int64(tid % 32) if pred else np.int64(0)
        for m in (1, 2, 4, 8, 16):
            w |= _ex(bi, w, tid ^ m, tid)
        return w

    def _limit(regs):
        return {}
else:
    from numba.cuda import libdevice

    @cuda.jit(device=True)
    def fma(a, b, c_):
        return libdevice.fmaf_rn(a, b, c_)

    @cuda.jit(device=True)
    def mul_rd(a, b):
        return libdevice.fmul_rd(a, b)

    def _pair(shfl):
        @cuda.jit(device=True)
        def f(v, m, bf, bi, tid):
            return shfl(FULL, v, m)

        # integers (code words, counts) are non-negative and below 2**32: one 32-bit shuffle each
        @cuda.jit(device=True)
        def i(v, m, bf, bi, tid):
            return np.int64(shfl(FULL, np.int32(v), m)) & M32

        return f, i

    xor_f, xor_i = _pair(cuda.shfl_xor_sync)
    down_f, down_i = _pair(cuda.shfl_down_sync)
    bcast_f, bcast_i = _pair(cuda.shfl_sync)

    @cuda.jit(device=True)
    def ballot(pred, bf, bi, tid):
        return np.int64(cuda.ballot_sync(FULL, pred)) & M32

    def _limit(regs):
        # a register cap raises the blocks resident per multiprocessor (256 threads: 48 -> 5 blocks,
        # 40 -> 6); the plain kernels spill at most 4 bytes there (scripts/kernel_spills.py)
        return {"max_registers": regs}


@cuda.jit(device=True)
def quotient(a, unit, y):
    """``a / unit``, IEEE-rounded, from ``y = 1 / unit`` (valid under the conditions of DIV_*)."""
    q0 = mul(a, y)
    return fma(fma(-q0, unit, a), y, q0)


F1 = np.float32(1.0)


def make_units(BITS, kind):
    """``units(scales, sb, b)``: (hi, lo) of bucket ``b`` of the scales at ``scales[sb]`` (QSGD: both
    the unit scale / s; 1-bit: the values of bits 1 and 0); ``value(code, hi, lo)``: a code's value."""
    S, SF = code_levels(BITS)

    @cuda.jit(device=True, inline="always")
    def units(scales, sb, b):
        if kind == DEC_QSGD:
            hi = scales[sb + b] / SF
            return hi, hi
        if kind == DEC_TWO_MEAN:
            return scales[sb + 2 * b], scales[sb + 2 * b + 1]
        hi = scales[sb + b]
        return hi, -hi

    @cuda.jit(device=True, inline="always")
    def value(cde, hi, lo):
        if kind == DEC_QSGD:
            return mul(np.float32(np.int32(cde - S)), hi)
        if cde:
            return hi
        return lo

    return units, value


def make_encode(spec):
    # one kernel per combination of the constants. REGK > 0: buckets of at most 32*REGK elements, held
    # in registers between the two passes; 0: any bucket size, pass 2 reads x again. PAIRED
    # (stochastic, REGK >= 2, buckets a multiple of 64): a lane's elements at steps 2t and 2t+1 (i and
    # i + 32 of an aligned group of 64) share one hash draw. SRC: reduce_requantize's sums
    BITS, red, pack, REGK, PAIRED, RESID = spec[:6]
    SRC = len(spec) > 6 and spec[6]
    KIND = dec_kind(red, pack)
    load = make_load(BITS, KIND, SRC)
    code_at = make_value(BITS, KIND)[0] if SRC else None
    units, value = make_units(BITS, KIND)
    NREG = max(REGK, 1)
    NSLOT = max(1, -(-REGK // (32 // BITS)))   # words kept per lane (REGK path)
    U8_ = np.uint64(8)
    U40_ = np.uint64(40)
    U24M = np.uint64(0xFFFFFF)
    S, SF = code_levels(BITS)
    EPW = 32 // BITS                      # codes per 32-bit word
    LOG_EPW = EPW.bit_length() - 1
    GMASK = EPW - 1
    HALF = EPW // 2

    def make_words(FASTDIV):
        @cuda.jit(device=True, inline="always")
        def words(vals, slots, lane, sh, pb, key, st, unit, y, thr, scale_ok, bf, bi, tid, residual, ln,
                  wres):
            """The REGK path's code words for BITS > 1, REGK >= EPW: for each group of EPW steps,
            every lane quantizes its EPW elements (codes shifted to their place), then a recursive
            halving over the EPW lanes of a word (shuffles at distances EPW/2, ..., 1) leaves lane i
            the whole word of step t*EPW + i in ``slots[t]``: one shuffle per word. FASTDIV: |x| / unit
            through ``y`` and ``thr`` (DIV_*), else the plain division. RESID and ``wres``: also the
            residuals of the bucket's ``ln`` elements."""
            parts = cuda.local.array(HALF, uint32)
            hi0 = (lane & HALF) != 0
            z = np.uint64(0)
            # 1 << sh, through an identity shuffle: opaque to the compiler, which would otherwise
            # turn the multiply below back into a shift (integer ALU: the encode's busiest pipe)
            place = np.uint32(bcast_i(np.uint32(1) << np.uint32(sh), lane, bf, bi, tid))
            for t in range(REGK // EPW):
                for u in range(EPW):
                    k = t * EPW + u
                    v = vals[k]
                    r = np.uint32(0)
                    if PAIRED:
                        if k % 2 == 0:
                            z = mix64(key + np.uint64(pb + np.uint32(k // 2 * 32)) * GAMMA)
                            r = np.uint32((z >> U8_) & U24M)
                        else:
                            r = np.uint32(z >> U40_)
                    elif pack == PACK_STOCH:
                        r = np.uint32(uniform24(key, np.uint32(st + np.uint32(k * 32 + lane))))
                    a = abs(v)
                    if FASTDIV:
                        vq = F0
                        if a > thr:
                            vq = max(quotient(a, unit, y), DIV_POS)
                    else:
                        vq = a / unit
                    cde = qsgd_round(vq, v < F0, SF, S, pack == PACK_STOCH, r)
                    if not FASTDIV and not scale_ok:     # (FASTDIV implies a good scale)
                        cde = np.int64(S)
                    if RESID and wres:
                        j = np.int32(k * 32 + lane)
                        if j < ln:
                            residual[np.uint32(st + j)] = v - mul(np.float32(np.int32(cde - S)), unit)
                    w = np.uint32(cde) * place           # (<< sh, as a multiply)
                    if u < HALF:
                        parts[u] = w
                    else:            # the first halving step at once: fewer codes held live
                        send = parts[u - HALF] if hi0 else w
                        keep = w if hi0 else parts[u - HALF]
                        parts[u - HALF] = keep | np.uint32(xor_i(send, HALF, bf, bi, tid))
                h = EPW >> 2
                while h:
                    hi = (lane & h) != 0
                    for u in range(h):
                        lo_w = parts[u]
                        hi_w = parts[u + h]
                        send = lo_w if hi else hi_w
                        keep = hi_w if hi else lo_w
                        parts[u] = keep | np.uint32(xor_i(send, h, bf, bi, tid))
                    h >>= 1
                slots[t] = parts[0]
        return words

    words_fast, words_plain = make_words(True), make_words(False)

    @cuda.jit(device=True, inline="always")
    def or_lanes(w, bf, bi, tid):
        """The OR of ``w`` over the EPW lanes of a code word (a xor butterfly)."""
        m = 1
        while m < EPW:
            w |= xor_i(w, m, bf, bi, tid)
            m <<= 1
        return w

    @cuda.jit(**_limit(ENC_REGS if BITS > 1 else ENC_REGS_1BIT))
    def warp_encode(x, payload, words, scales, header, n, nb, bs, K, ngroups, key, residual,
                    ppay, pwords, pscales, status, expect, check, check_name, npay, pw, psoff, rin,
                    has_rin):
        key = mix64(key)            # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
        # indices are 32-bit unsigned (n < 2**31; unsigned: no negative-index wraparound code)
        tid = cuda.threadIdx.x
        lane = np.int32(tid & 31)
        nw = cuda.blockDim.x >> 5
        bf = cuda.shared.array(SIMBUF, float32)
        bi = cuda.shared.array(SIMBUF, int64)
        bad = False
        if SRC:
            sred = cuda.shared.array(SHARED, int32)
            serr = cuda.shared.array(1, int32)
            bad = multi_bad(ppay, npay, pw * 4, status, expect, check, check_name, sred, serr)
        if cuda.blockIdx.x == 0 and tid < 64:
            payload[tid] = header_byte(header, tid)
        sh = np.int32((lane & GMASK) * BITS)
        g = cuda.blockIdx.x
        while g < ngroups:                          # uniform over the block
            b = np.int32(g * nw + (tid >> 5))
            st = np.uint32(0)
            ln = np.int32(0)
            if b < nb:
                st = np.uint32(b * bs)
                ln = np.int32(min(bs, n - b * bs))
            vals = cuda.local.array(NREG, float32)
            if REGK and SRC:
                # source()'s sums, element for element (payload order, then rin), each payload's
                # unit computed once per bucket: payload q's values for every step, then the next
                q = 0
                while q < npay:                 # (a while loop: a range loop spills more here)
                    hi = F0
                    lo = F0
                    if b < nb:
                        hi, lo = units(pscales, q * pw + psoff, np.int64(b))
                    wq = q * pw + HDR_WORDS
                    for k in range(REGK):
                        j = np.int32(k * 32 + lane)
                        if j < ln:
                            v = value(code_at(pwords, wq, np.int64(st + j)), hi, lo)
                            if q:
                                v = vals[k] + v
                            vals[k] = v
                        elif q == 0:
                            vals[k] = F0
                    q += 1
                for k in range(REGK):
                    j = np.int32(k * 32 + lane)
                    if j < ln:
                        if has_rin:
                            vals[k] = vals[k] + rin[np.uint32(st + j)]
                        if bad:
                            vals[k] = FNAN
            elif REGK:
                for k in range(REGK):                   # every load first, then the sums in order
                    j = np.int32(k * 32 + lane)
                    v = F0
                    if j < ln:
                        v = load(x, np.uint32(st + j), b, bad, pwords, pscales, npay, pw, psoff, rin,
                                 has_rin)
                    vals[k] = v
            # pass 1: the bucket's scale(s), canonical order
            p = F0
            q = F0
            cnt = np.int64(0)
            for k in range(REGK if REGK else K):
                j = np.int32(k * 32 + lane)
                if j < ln:
                    if REGK:
                        v = vals[k]
                    else:
                        v = load(x, np.uint32(st + j), b, bad, pwords, pscales, npay, pw, psoff, rin,
                                 has_rin)
                    p, q, cnt = add_term(red, v, p, q, cnt)
            if red == MAX:
                for m in (16, 8, 4, 2, 1):
                    p = max_nan(p, xor_f(p, m, bf, bi, tid))
            else:
                for d in (16, 8, 4, 2, 1):
                    op = down_f(p, d, bf, bi, tid)
                    if red == TWO_MEAN:
                        oq = down_f(q, d, bf, bi, tid)
                        oc = down_i(cnt, d, bf, bi, tid)
                    if lane < d:
                        p = p + op
                        if red == TWO_MEAN:
                            q = q + oq
                            cnt = cnt + oc
                p = bcast_f(p, 0, bf, bi, tid)
                if red == TWO_MEAN:
                    q = bcast_f(q, 0, bf, bi, tid)
                    cnt = bcast_i(cnt, 0, bf, bi, tid)
            scale = p
            if pack != PACK_ONEBIT:
                if red == L2:
                    scale = sqrt32(p)
                if lane == 0 and b < nb:
                    scales[np.uint32(b)] = scale
            hi1 = F0                # 1 bit: the values of bits 1 and 0 (every lane: residuals)
            lo1 = F0
            if pack == PACK_ONEBIT and ln > 0:
                hi1, lo1 = onebit_scales(red == TWO_MEAN, p, q, cnt, ln)
                if lane == 0:
                    if red == TWO_MEAN:
                        scales[np.uint32(2 * b)] = hi1
                        scales[np.uint32(2 * b + 1)] = lo1
                    else:
                        scales[np.uint32(b)] = hi1
            unit = scale / SF
            # pass 2: codes, one 32-bit word per group of EPW lanes
            wb = np.uint32(st >> LOG_EPW)
            if REGK:
                # Branch-free: a bad scale gives level 0 (offset s) for every element, elements past
                # the bucket's end are quantized from 0.0 and cleared at the store; each word is kept
                # by one lane of its group (i == k % EPW, slot k // EPW) and stored after the loop.
                scale_ok = scale > F0 and scale < FINF
                i = lane & GMASK
                z = np.uint64(0)
                slots = cuda.local.array(NSLOT, uint32)
                slots2 = cuda.local.array(NSLOT if SIMULATOR else 1, uint32)
                if BITS > 1 and REGK >= EPW:
                    fast = scale_ok and unit >= DIV_UNIT_MIN and unit <= DIV_UNIT_MAX
                    y = F1
                    thr = F0
                    if fast:
                        y = F1 / unit
                        thr = mul_rd(mul(unit, DIV_2M50), DIV_2M100)    # RD(unit * 2**-150)
                    # draw()'s counter for this lane's first pair (PAIRED), then + 32 per pair
                    pb = np.uint32(((st >> np.uint32(6)) << np.uint32(5)) + np.uint32(lane))
                    if SIMULATOR:     # both, in every warp: the emulated shuffles need them all
                        words_fast(vals, slots2, lane, sh, pb, key, st, unit, y, thr, scale_ok,
                                   bf, bi, tid, residual, ln, fast)
                        words_plain(vals, slots, lane, sh, pb, key, st, unit, y, thr, scale_ok,
                                    bf, bi, tid, residual, ln, not fast)
                        if fast:
                            for t in range(NSLOT):
                                slots[t] = slots2[t]
                    elif fast:
                        words_fast(vals, slots, lane, sh, pb, key, st, unit, y, thr, scale_ok, bf,
                                   bi, tid, residual, ln, True)
                    else:
                        words_plain(vals, slots, lane, sh, pb, key, st, unit, y, thr, scale_ok,
                                    bf, bi, tid, residual, ln, True)
                for k in range(REGK if (BITS == 1 or REGK < EPW) else 0):
                    v = vals[k]
                    j = np.int32(k * 32 + lane)
                    if BITS == 1:
                        w = ballot(v >= F0, bf, bi, tid)
                        if RESID and j < ln:
                            residual[np.uint32(st + j)] = v - (hi1 if v >= F0 else lo1)
                    else:
                        e = np.uint32(st + np.uint32(k * 32 + lane))
                        r = np.uint32(0)
                        if PAIRED:
                            if k % 2 == 0:
                                z = draw(key, e)
                                r = np.uint32((z >> U8_) & U24M)
                            else:
                                r = np.uint32(z >> U40_)
                        elif pack == PACK_STOCH:
                            r = np.uint32(uniform24(key, e))
                        cde = qsgd_level(v, unit, SF, S, pack == PACK_STOCH, r)
                        if not scale_ok:
                            cde = np.int64(S)
                        if RESID and j < ln:
                            residual[e] = v - mul(np.float32(np.int32(cde - S)), unit)
                        w = or_lanes(np.int64(np.uint32(cde) << np.uint32(sh)), bf, bi, tid)
                    if i == k % EPW:
                        slots[k // EPW] = np.uint32(w & M32)
                gi = lane >> LOG_EPW                    # this lane's group: word k*BITS + gi of step k
                for t in range(NSLOT):
                    k = t * EPW + i
                    first = np.int32(k * 32 + gi * EPW)  # the word's first element in the bucket
                    if k < REGK and first < ln:
                        w32 = slots[t]
                        if ln - first < EPW:            # the bucket's last, partial word
                            w32 &= np.uint32((1 << ((ln - first) * BITS)) - 1)
                        words[np.uint32(wb + np.uint32(k * BITS + gi))] = w32
            else:
                for k in range(K):
                    j = np.int32(k * 32 + lane)
                    ok = j < ln
                    e = np.uint32(st + j)
                    v = F0
                    if ok:
                        v = load(x, e, b, bad, pwords, pscales, npay, pw, psoff, rin, has_rin)
                    if BITS == 1:
                        w = ballot(ok and v >= F0, bf, bi, tid)
                        if RESID and ok:
                            residual[e] = v - (hi1 if v >= F0 else lo1)
                    else:
                        cde = np.int64(0)
                        if ok:
                            cde = qsgd_code(v, scale, unit, SF, S, pack == PACK_STOCH, key, e)
                            if RESID:
                                residual[e] = v - mul(np.float32(np.int32(cde - S)), unit)
                        w = or_lanes(np.int64(np.uint32(cde) << np.uint32(sh)), bf, bi, tid)
                    if ok and (lane & GMASK) == 0:
                        words[np.uint32(wb + np.uint32(j >> LOG_EPW))] = np.uint32(w & M32)
            g += cuda.gridDim.x

    return warp_encode


def make_decode(spec):
    # REGK > 0: buckets of REGK steps (unrolled) take the shuffle path. MODE: PLAIN (``words``/``scales``:
    # one payload's), or the whole buffer (offsets in 4-byte units, ``pw`` per payload) of MULTI_SUM or
    # MULTI_CHUNKS (bucket b from chunk b // bpc's payload; the last chunk's scales at ``last_psoff``).
    BITS, kind, REGK = spec[:3]
    MODE = spec[3] if len(spec) > 3 else PLAIN
    EPW = 32 // BITS
    LOG_EPW = EPW.bit_length() - 1
    GMASK = EPW - 1
    MASK = np.uint32((1 << BITS) - 1)
    NHELD = max(1, -(-REGK * BITS // 32))   # code words per lane of a bucket of REGK steps
    REGSUM = MODE == MULTI_SUM and REGK > 0     # sums of whole buckets in registers
    NBAD = MAXCH if MODE == MULTI_CHUNKS else 1

    units, value = make_units(BITS, kind)

    @cuda.jit(**_limit(DEC_REGS if MODE == PLAIN else DEC_REGS_MULTI))
    def warp_decode(payload, words, scales, out, status, expect, check, check_name, n, nb, bs, K,
                    ngroups, accumulate, name_hashes, npay, pw, psoff, bpc, last_psoff):
        tid = cuda.threadIdx.x
        lane = np.int32(tid & 31)
        nw = cuda.blockDim.x >> 5
        serr = cuda.shared.array(1, int32)
        bf = cuda.shared.array(SIMBUF, float32)
        bi = cuda.shared.array(SIMBUF, int64)
        sbad = cuda.shared.array(NBAD, int32)
        acc = cuda.local.array(REGK if REGSUM else 1, float32)
        nch = np.int64(1)
        if MODE == PLAIN:
            bad = block_bad(payload, status, expect, check, check_name, serr)
        elif MODE == MULTI_SUM:
            sred = cuda.shared.array(SHARED, int32)
            bad = multi_bad(payload, npay, pw * 4, status, expect, check, check_name, sred, serr)
        else:
            nch = (nb + bpc - 1) // bpc
            chunks_bad(payload, nch, pw * 4, bpc * bs, n - (nch - 1) * bpc * bs, status, expect, check,
                       check_name, name_hashes, sbad, serr)
            bad = serr[0] != 0
        npass = npay if MODE == MULTI_SUM else 1
        sh = np.uint32((lane & GMASK) * BITS)
        g = cuda.blockIdx.x
        gi = lane >> LOG_EPW                # this lane's word within a step's BITS words
        while g < ngroups:                  # uniform over the block
            b = np.int32(g * nw + (tid >> 5))
            st = np.uint32(0)
            ln = np.int32(0)
            lb = np.int64(b)                # the bucket within its payload
            pj = np.int64(0)                # MULTI_CHUNKS: its chunk
            if b < nb:
                st = np.uint32(b * bs)
                ln = np.int32(min(bs, n - b * bs))
                if MODE == MULTI_CHUNKS:
                    pj = lb // bpc
                    lb -= pj * bpc
                    if check:
                        bad = sbad[pj] != 0
            k = 0
            while k < npass:                # (uniform over the block; a range loop here, one pass
                                            # in the plain decode, made ptxas spill 44 bytes there)
                wb = np.int64(st >> LOG_EPW)
                sb = np.int64(0)
                if MODE == MULTI_SUM:
                    wb += k * pw + HDR_WORDS
                    sb = k * pw + psoff
                elif MODE == MULTI_CHUNKS:
                    wb = pj * pw + HDR_WORDS + ((lb * bs) >> LOG_EPW)
                    sb = pj * pw + (last_psoff if pj == nch - 1 else psoff)
                hi = F0
                lo = F0
                if b < nb:
                    hi, lo = units(scales, sb, lb)
                if bad:                     # every value NaN, whatever its code
                    hi = FNAN
                    lo = FNAN
                if REGK and (SIMULATOR or ln == REGK * 32):    # (a whole bucket: uniform over the warp)
                    # The bucket's code words, read coalesced before any store (a load per element
                    # would wait behind the previous store, which may alias it), then taken from their
                    # lanes with one shuffle per element; unconditional stores. (The simulator's
                    # shuffles need every warp: it takes this path for every bucket, stores guarded.)
                    nwd = np.int32((ln + EPW - 1) >> LOG_EPW)
                    held = cuda.local.array(NHELD, uint32)
                    for m in range(NHELD):
                        wi = np.int32(m * 32 + lane)
                        w = np.uint32(0)
                        if wi < nwd:
                            w = words[np.uint64(wb) + np.uint64(wi)]
                        held[m] = w
                    for t in range(REGK):
                        wd = np.uint32(bcast_i(held[(t * BITS) >> 5], ((t * BITS) & 31) + gi, bf, bi,
                                               tid))
                        val = value(np.int32((wd >> sh) & MASK), hi, lo)
                        j = np.int32(t * 32 + lane)
                        if REGSUM:
                            if k == 0:
                                acc[t] = val
                            else:
                                acc[t] = acc[t] + val
                            if k == npass - 1 and (not SIMULATOR or j < ln):
                                out[np.uint32(st + j)] = acc[t]
                        elif not SIMULATOR or j < ln:
                            put(out, np.uint32(st + j), val, accumulate)
                else:                       # a bucket's last, partial, steps; or REGK == 0
                    for t in range(K):      # (several payloads: the sums go through out)
                        j = np.int32(t * 32 + lane)
                        if j < ln:
                            put(out, np.uint32(st + j),
                                value(np.int32((words[np.uint64(wb) + np.uint64(j >> LOG_EPW)] >> sh) & MASK),
                                      hi, lo),
                                accumulate or k > 0)
                k += 1
            g += cuda.gridDim.x

    return warp_decode
