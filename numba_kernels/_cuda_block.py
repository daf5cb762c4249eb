"""The general CUDA kernels: any bit width, any bucket size; used wherever the warp kernels
(``_cuda_warp``) do not apply (OneBit's default one bucket per tensor included).

* ``block_encode`` (``make_encode``), one launch for buckets of at most ``FUSE_MAX`` elements
  ("fused"): a block owns G whole buckets (G*bs*bits a multiple of 32). Phase 1: warp w computes the
  scales of buckets w, w+NW, ... in the canonical order (lane l adds elements l, l+32, ..., then the
  shared-memory tree 16..1). Phase 2: one thread per 32-bit code word quantizes the elements that
  touch it; the padding words come out zero. Larger buckets take ``reduce`` (a warp per segment of
  ``SEGMENT`` elements, its lane sums to scratch) and ``combine`` (a warp per bucket over its
  segments' sums), then ``block_encode`` in pack-only mode (G words per block, G a multiple of
  ``bits``), so one bucket of a whole tensor is read by the whole GPU. With ``resid`` the encode writes
  ``residual = x - decode``: an element straddling two words is written by its last word's thread
  after a block barrier, so ``residual`` may be ``x``.
* ``block_decode`` (``make_decode``): grid-stride over chunks of DEC_K*BLOCK elements: a shared table of
  unit = scale/s for the chunk's buckets, then coalesced stores; the header check runs in the decode
  (``block_bad``). ``block_decode_multi``: the same over several payloads (decode_sum, decode_chunks).
* ``k_header`` writes a header; ``k_check`` checks one (raw payloads: fp16, none, fake).
"""
import numpy as np
from numba import cuda, float32, int32, int64

from ._cuda_device import (BLOCK, DEC_MEAN_ABS, DEC_QSGD, DEC_TWO_MEAN, L2, MAX, PACK_ONEBIT, PACK_STOCH,
                           SHARED, SIMULATOR, TWO_MEAN, add_term, block_bad, bucket_of, hdr_err, header_byte,
                           header_errors, code_levels, max_nan, mix64, mul, onebit_scales, publish, put, qsgd_code,
                           sqrt32)
from ._scalar import F0, FNAN, SEGMENT

FUSE_MAX = SEGMENT                  # buckets above this take reduce + combine + pack-only
ENC_ELEMS = 256 if SIMULATOR else 4096   # elements per block targeted by the fused encode
MAXG = 1024                         # buckets per encode block (shared memory: 2 floats per bucket)
PACK_WORDS = 2 * BLOCK              # about this many words per block in pack-only mode
DEC_K = 2 if SIMULATOR else 8       # elements per thread per decode chunk
DEC_CHUNK = DEC_K * BLOCK
DEC_TABLE = DEC_CHUNK + 8           # units of the buckets one chunk touches (bs=1: one per element)
M32 = np.int64(0xFFFFFFFF)
MAXCH = 1024                        # chunks of a decode_chunks (a shared table of their errors)
PLAIN, MULTI_SUM, MULTI_CHUNKS = -1, 0, 1   # decode modes: one payload; sum n payloads; a payload per chunk
HDR_WORDS = 16                      # the header, in 32-bit words


@cuda.jit(device=True)
def multi_bad(payloads, npay, ptotal, status, expect, check, check_name, sred, serr):
    """Whether any of the ``npay`` payloads of ``ptotal`` bytes back to back in ``payloads`` is bad
    (with ``check`` their headers' OR, as :func:`publish`; else ``status[0]``). ``sred``: shared
    int32[SHARED], ``serr``: shared int32[1]. Every thread must call it (barriers)."""
    tid = cuda.threadIdx.x
    err = 0
    if check:
        k = tid
        while k < npay:
            err |= hdr_err(payloads[k * ptotal:(k + 1) * ptotal], expect, check_name)
            k += cuda.blockDim.x
    sred[tid] = err
    cuda.syncthreads()
    if tid == 0:
        e = 0
        if check:
            for t in range(cuda.blockDim.x):
                e |= sred[t]
        publish(status, check, e, serr)
    cuda.syncthreads()
    return serr[0] != 0


@cuda.jit(device=True)
def chunks_bad(payloads, nch, ptotal, chunk, last_numel, status, expect, check, check_name, name_hashes,
               sbad, serr):
    """The header errors of the ``nch`` chunk payloads (chunk j's at ``j * ptotal``, ``chunk``
    elements, the last ``last_numel``; with ``check_name`` named ``name_hashes[j]``) into ``sbad[j]``,
    their OR published (:func:`publish`); without ``check`` every chunk is bad when ``serr[0]``."""
    tid = cuda.threadIdx.x
    j = tid
    while j < nch:
        e = 0
        if check:
            m = chunk
            if j == nch - 1:
                m = last_numel
            nh = np.int64(0)
            if check_name:
                nh = np.int64(name_hashes[j])
            e = header_errors(payloads[j * ptotal:j * ptotal + 64], expect[0], expect[1], expect[2],
                              expect[3], expect[4], m, nh, check_name)
        sbad[j] = e
        j += cuda.blockDim.x
    cuda.syncthreads()
    if tid == 0:
        e = 0
        if check:
            for t in range(nch):
                e |= sbad[t]
        publish(status, check, e, serr)
    cuda.syncthreads()


def make_value(BITS, kind):
    """``code_at(words, wb, le)``: the code of element ``le`` of the code words at ``words[wb]``;
    ``decoded(code, units, b, b0, scales, sb, lb)``: its value (QSGD: from ``units[b - b0]``; 1-bit:
    bucket ``lb``'s scales at ``scales[sb]``); ``value(words, scales, wb, sb, le, lb)``: both."""
    S, SF = code_levels(BITS)
    MASK = np.int64((1 << BITS) - 1)

    @cuda.jit(device=True)
    def code_at(words, wb, le):
        bitpos = le * BITS
        wi = wb + (bitpos >> 5)
        sh = bitpos & 31
        v = np.int64(words[wi]) >> sh
        if sh + BITS > 32:
            v |= np.int64(words[wi + 1]) << (32 - sh)
        return v & MASK

    @cuda.jit(device=True, inline="always")
    def decoded(code, units, b, b0, scales, sb, lb):
        if kind == DEC_QSGD:
            return mul(np.float32(np.int32(code - S)), units[b - b0])
        if kind == DEC_TWO_MEAN:
            if code:
                return scales[sb + 2 * lb]
            return scales[sb + 2 * lb + 1]
        v = scales[sb + lb]
        if not code:
            v = -v
        return v

    @cuda.jit(device=True)
    def value(words, scales, wb, sb, le, lb):
        code = code_at(words, wb, le)
        if kind == DEC_QSGD:
            return mul(np.float32(np.int32(code - S)), scales[sb + lb] / SF)
        return decoded(code, scales, 0, 0, scales, sb, lb)

    return code_at, decoded, value


def make_source(BITS, kind):
    """``source(words, scales, i, b, npay, pw, psoff, rin, has_rin)``: the float32 sum, in payload
    order, of element ``i`` (bucket ``b``) of the ``npay`` payloads of ``pw`` words (scales at word
    ``psoff`` of each), plus ``rin[i]`` when ``has_rin``: what a reduce_requantize quantizes."""
    value = make_value(BITS, kind)[2]

    @cuda.jit(device=True)
    def source(words, scales, i, b, npay, pw, psoff, rin, has_rin):
        v = value(words, scales, HDR_WORDS, psoff, i, b)
        for k in range(1, npay):
            v = v + value(words, scales, k * pw + HDR_WORDS, k * pw + psoff, i, b)
        if has_rin:
            v = v + rin[i]
        return v

    return source


def make_load(BITS, kind, SRC):
    """``load(x, i, b, bad, pwords, pscales, npay, pw, psoff, rin, has_rin)``: the value an encode
    quantizes, ``x[i]``, or with ``SRC`` (reduce_requantize) ``source``'s sum, NaN when ``bad``."""
    source = make_source(BITS, kind) if SRC else None

    @cuda.jit(device=True, inline="always")
    def load(x, i, b, bad, pwords, pscales, npay, pw, psoff, rin, has_rin):
        if SRC:
            v = source(pwords, pscales, np.int64(i), np.int64(b), npay, pw, psoff, rin, has_rin)
            if bad:
                v = FNAN
            return v
        return x[i]

    return load


def dec_kind(red, pack):
    if pack != PACK_ONEBIT:
        return DEC_QSGD
    return DEC_TWO_MEAN if red == TWO_MEAN else DEC_MEAN_ABS


def make_reduce(spec):
    """``spec``: (red,) or (red, bits, pack, True): the values are the sums of payloads (``source``).
    The first of a long bucket's two launches: a warp per segment (SEGMENT elements of one bucket)
    writes its lane sum to ``parts`` (``p`` at ``w``, ``q`` at ``nseg + w``, the count at
    ``2*nseg + w``, w the segment's index, bucket-major)."""
    red = spec[0]
    SRC = len(spec) > 1
    load = make_load(spec[1], dec_kind(red, spec[2]), True) if SRC else make_load(None, None, False)

    @cuda.jit
    def reduce(x, parts, numel, bs, nb, ppay, pwords, pscales, status, expect, check, check_name,
               npay, pw, psoff, rin, has_rin):
        tid = cuda.threadIdx.x
        lane = tid % 32
        spb = (bs + SEGMENT - 1) // SEGMENT
        nseg = nb * spb
        w = np.int64(cuda.blockIdx.x) * (cuda.blockDim.x // 32) + tid // 32
        b = w // spb
        sp = cuda.shared.array(SHARED, float32)
        sq = cuda.shared.array(SHARED, float32)
        sc = cuda.shared.array(SHARED, int64)
        bad = False
        if SRC:
            sred = cuda.shared.array(SHARED, int32)
            serr = cuda.shared.array(1, int32)
            bad = multi_bad(ppay, npay, pw * 4, status, expect, check, check_name, sred, serr)
        p = F0
        q = F0
        cnt = 0
        st = b * bs + (w - b * spb) * SEGMENT
        en = min(numel, b * bs + bs, st + SEGMENT)
        if w < nseg:
            i = st + lane
            while i < en:
                xv = load(x, i, b, bad, pwords, pscales, npay, pw, psoff, rin, has_rin)
                p, q, cnt = add_term(red, xv, p, q, cnt)
                i += 32
        lane_tree(red, p, q, cnt, sp, sq, sc, tid, lane)
        if lane == 0 and w < nseg:
            parts[w] = sp[tid]
            if red != MAX:
                parts[nseg + w] = sq[tid]
                parts[2 * nseg + w] = float32(sc[tid])     # at most SEGMENT: exact
    return reduce


def make_combine(spec):
    """``spec``: (red,). The second launch: a warp per bucket adds its segments' sums from ``parts`` in
    the canonical order and writes the bucket's scale(s). Same parameters as ``reduce``."""
    red = spec[0]

    @cuda.jit
    def combine(parts, scales, numel, bs, nb, ppay, pwords, pscales, status, expect, check, check_name,
                npay, pw, psoff, rin, has_rin):
        tid = cuda.threadIdx.x
        lane = tid % 32
        spb = (bs + SEGMENT - 1) // SEGMENT
        nseg = nb * spb
        b = np.int64(cuda.blockIdx.x) * (cuda.blockDim.x // 32) + tid // 32
        sp = cuda.shared.array(SHARED, float32)
        sq = cuda.shared.array(SHARED, float32)
        sc = cuda.shared.array(SHARED, int64)
        p = F0
        q = F0
        cnt = 0
        if b < nb:
            k = lane
            while k < spb:
                w = b * spb + k
                if red == MAX:
                    p = max_nan(p, parts[w])
                else:
                    p = p + parts[w]
                    q = q + parts[nseg + w]
                    cnt += int64(parts[2 * nseg + w])
                k += 32
        lane_tree(red, p, q, cnt, sp, sq, sc, tid, lane)
        if lane == 0 and b < nb:
            put_scales(red, scales, b, sp[tid], sq[tid], sc[tid], min(numel, b * bs + bs) - b * bs)
    return combine


@cuda.jit(device=True, inline="always")
def put_scales(red, scales, b, p, q, cnt, ln):
    """Bucket ``b``'s scale(s) from its reduction (p, q, cnt over ``ln`` elements) into ``scales``;
    returns (scale, 1-bit's value of bit 0)."""
    if red == MAX or red == L2:
        if red == L2:
            p = sqrt32(p)
        scales[b] = p
        return p, p
    hi, lo = onebit_scales(red == TWO_MEAN, p, q, cnt, ln)
    if red == TWO_MEAN:
        scales[2 * b] = hi
        scales[2 * b + 1] = lo
    else:
        scales[b] = hi
    return hi, lo


@cuda.jit(device=True)
def lane_tree(red, p, q, cnt, sp, sq, sc, tid, lane):
    """Each warp's tree (strides 16..1) over its lanes' (p, q, cnt), into sp/sq/sc at its first
    thread. Every thread of the block calls it (barriers)."""
    sp[tid] = p
    sq[tid] = q
    sc[tid] = cnt
    cuda.syncthreads()
    stride = 16
    while stride > 0:
        if lane < stride:
            if red == MAX:
                sp[tid] = max_nan(sp[tid], sp[tid + stride])
            else:
                sp[tid] = sp[tid] + sp[tid + stride]
                sq[tid] = sq[tid] + sq[tid + stride]
                sc[tid] = sc[tid] + sc[tid + stride]
        cuda.syncthreads()
        stride //= 2


def make_encode(spec):
    """``spec``: (bits, red, pack, resid[, src]); ``src`` (reduce_requantize): the values are
    ``source``'s sums, computed wherever the plain encode reads ``x``."""
    BITS, red, pack, RESID = spec[:4]
    SRC = len(spec) > 4 and spec[4]
    load = make_load(BITS, dec_kind(red, pack), SRC)
    S, SF = code_levels(BITS)
    PER = 32 // BITS + 2           # at most this many elements touch one 32-bit word
    ONEBIT = pack == PACK_ONEBIT
    STOCH = pack == PACK_STOCH

    @cuda.jit(device=True, inline="always")
    def units(fused, b, b0, ssc, sunit, scales):
        """Bucket ``b``'s (scale, unit) (1 bit: the values of bits 1 and 0)."""
        if fused:
            return ssc[b - b0], sunit[b - b0]
        if ONEBIT:
            if red == TWO_MEAN:
                return scales[2 * b], scales[2 * b + 1]
            return scales[b], -scales[b]
        return scales[b], scales[b] / SF

    @cuda.jit
    def block_encode(x, payload, words, scales, header, n, nb, bs, inv_bs, G, fused, key, residual,
                     ppay, pwords, pscales, status, expect, check, check_name, npay, pw, psoff, rin,
                     has_rin):
        key = mix64(key)            # the caller's key, finished (docs/CODECS.md, "Noise and seeds")
        tid = cuda.threadIdx.x
        blk = cuda.blockIdx.x
        nthr = cuda.blockDim.x
        lane = tid % 32
        warp = tid // 32
        nw = nthr // 32
        sp = cuda.shared.array(SHARED, float32)
        sq = cuda.shared.array(SHARED, float32)
        sc = cuda.shared.array(SHARED, int64)
        ssc = cuda.shared.array(MAXG, float32)
        sunit = cuda.shared.array(MAXG, float32)
        rv = cuda.local.array(PER, float32)
        ri = cuda.local.array(PER, int64)
        bad = False
        if SRC:
            sred = cuda.shared.array(SHARED, int32)
            serr = cuda.shared.array(1, int32)
            bad = multi_bad(ppay, npay, pw * 4, status, expect, check, check_name, sred, serr)
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
                        xv = load(x, i, b0 + lb, bad, pwords, pscales, npay, pw, psoff, rin, has_rin)
                        p, q, cnt = add_term(red, xv, p, q, cnt)
                        i += 32
                lane_tree(red, p, q, cnt, sp, sq, sc, tid, lane)
                if lane == 0 and lb < nbl:
                    hi, lo = put_scales(red, scales, b0 + lb, sp[tid], sq[tid], sc[tid], en - st)
                    ssc[lb] = hi
                    sunit[lb] = lo if ONEBIT else hi / SF
                cuda.syncthreads()     # the next round reuses sp/sq/sc; phase 2 reads ssc/sunit
        # phase 2: 32-bit code words [w0, w1) of this block (the last block also writes the padding)
        if fused:
            w0 = (b0 * bs * BITS) // 32
            if b1 >= nb:
                w1 = np.int64(words.size)
            else:
                w1 = (b1 * bs * BITS) // 32
        else:
            # pack-only: words are assigned to blocks directly, G per block (not buckets: b0 is unused)
            w0 = np.int64(blk) * G
            w1 = min(np.int64(words.size), w0 + G)
        rounds = (w1 - w0 + nthr - 1) // nthr
        if rounds < 0:
            rounds = 0
        for rd in range(rounds):        # uniform over the block (RESID: a barrier per round)
            w = w0 + rd * nthr + tid
            nres = 0
            if w < w1:
                bit0 = w * 32
                e = bit0 // BITS
                e_end = min(n, (bit0 + 32 + BITS - 1) // BITS)
                acc = np.int64(0)
                if e < e_end:
                    b = bucket_of(e, bs, inv_bs)
                    bend = (b + 1) * bs
                    scale, unit = units(fused, b, b0, ssc, sunit, scales)
                    for _ in range(PER):
                        if e < e_end:
                            if e >= bend:
                                b += 1
                                bend += bs
                                scale, unit = units(fused, b, b0, ssc, sunit, scales)
                            xv = load(x, e, b, bad, pwords, pscales, npay, pw, psoff, rin, has_rin)
                            if ONEBIT:
                                c = np.int64(0)
                                d = unit               # (1-bit: scale = value of 1, unit = of 0)
                                if xv >= F0:
                                    c = np.int64(1)
                                    d = scale
                            else:
                                c = qsgd_code(xv, scale, unit, SF, S, STOCH, key, e)
                                d = mul(np.float32(np.int32(c - S)), unit)
                            sh = e * BITS - bit0
                            if sh >= 0:
                                acc |= c << sh
                            else:
                                acc |= c >> (-sh)
                            if RESID and (e + 1) * BITS <= bit0 + 32:    # its last bit is here
                                rv[nres] = xv - d
                                ri[nres] = e
                                nres += 1
                            e += 1
                words[w] = np.uint32(acc & M32)
            if RESID:
                cuda.syncthreads()      # every read of x in this round comes before any write
                for k in range(nres):
                    residual[ri[k]] = rv[k]
        if blk == 0 and tid < 64:
            payload[tid] = header_byte(header, tid)

    return block_encode


def make_decode(spec):
    BITS, kind = spec
    S, SF = code_levels(BITS)
    code_at, decoded, _ = make_value(BITS, kind)

    @cuda.jit
    def block_decode(payload, words, scales, out, status, expect, check, check_name, n, bs, inv_bs,
                     accumulate, nchunks):
        tid = cuda.threadIdx.x
        nthr = cuda.blockDim.x
        serr = cuda.shared.array(1, int32)
        sunit = cuda.shared.array(DEC_TABLE, float32)
        bad = block_bad(payload, status, expect, check, check_name, serr)
        chunk = np.int64(cuda.blockIdx.x)
        per = np.int64(nthr) * DEC_K
        while chunk < nchunks:
            base = chunk * per
            last = min(n, base + per) - 1
            bl0 = bucket_of(base, bs, inv_bs)
            if kind == DEC_QSGD:
                nbl = bucket_of(last, bs, inv_bs) - bl0 + 1
                j = tid
                while j < nbl:
                    sunit[j] = scales[bl0 + j] / SF
                    j += nthr
                cuda.syncthreads()
            for k in range(DEC_K):
                i = base + k * nthr + tid
                if i < n:
                    code = code_at(words, 0, i)
                    b = bucket_of(i, bs, inv_bs)
                    val = decoded(code, sunit, b, bl0, scales, 0, b)
                    if bad:
                        val = FNAN
                    put(out, i, val, accumulate)
            if kind == DEC_QSGD:
                cuda.syncthreads()     # the next chunk overwrites the table
            chunk += cuda.gridDim.x

    return block_decode


def make_decode_multi(spec):
    """``block_decode_multi``: ``block_decode`` over several payloads of ``pw`` words back to back
    (``words``/``scales``: the whole buffer; offsets in 4-byte units). MULTI_SUM: out = the float32
    sum, in payload order, of the ``npay`` payloads (each element's partial sums in registers, the
    shared table refilled per payload); any bad payload makes every value NaN. MULTI_CHUNKS: element i
    is element ``i - j*chunk`` of chunk j's payload (the last chunk's scales at ``last_psoff``); a bad
    chunk decodes to NaN."""
    BITS, kind, MODE = spec
    S, SF = code_levels(BITS)
    code_at, decoded, _ = make_value(BITS, kind)
    CHUNKS = MODE == MULTI_CHUNKS
    NBAD = MAXCH if CHUNKS else 1

    @cuda.jit(device=True, inline="always")
    def locate(i, b, k, chunk, bpc, nch, pw, psoff, last_psoff):
        """Element ``i`` of bucket ``b`` in pass ``k``: its payload, its bucket's and its own index
        there, and that payload's scales."""
        pj = k
        le = i
        lb = b
        if CHUNKS:
            pj = b // bpc
            lb = b - pj * bpc
            le = i - pj * chunk
        sb = pj * pw + psoff
        if CHUNKS and pj == nch - 1:
            sb = pj * pw + last_psoff
        return pj, lb, le, sb

    @cuda.jit
    def block_decode_multi(payloads, words, scales, out, status, expect, check, check_name, name_hashes,
                           n, bs, inv_bs, nchunks, npay, pw, psoff, chunk, last_numel, last_psoff):
        tid = cuda.threadIdx.x
        nthr = cuda.blockDim.x
        serr = cuda.shared.array(1, int32)
        sred = cuda.shared.array(SHARED, int32)
        sbad = cuda.shared.array(NBAD, int32)
        sunit = cuda.shared.array(DEC_TABLE, float32)
        acc = cuda.local.array(DEC_K, float32)
        nch = (n + chunk - 1) // chunk
        bpc = chunk // bs
        bad = False
        if CHUNKS:
            chunks_bad(payloads, nch, pw * 4, chunk, last_numel, status, expect, check, check_name,
                       name_hashes, sbad, serr)
            npass = 1
        else:
            bad = multi_bad(payloads, npay, pw * 4, status, expect, check, check_name, sred, serr)
            npass = npay
        c = np.int64(cuda.blockIdx.x)
        per = np.int64(nthr) * DEC_K
        while c < nchunks:
            base = c * per
            last = min(n, base + per) - 1
            bl0 = bucket_of(base, bs, inv_bs)
            nbl = bucket_of(last, bs, inv_bs) - bl0 + 1
            for k in range(npass):
                if kind == DEC_QSGD:
                    j = tid
                    while j < nbl:
                        pj, lb, _, sb = locate(0, bl0 + j, k, chunk, bpc, nch, pw, psoff, last_psoff)
                        sunit[j] = scales[sb + lb] / SF
                        j += nthr
                    cuda.syncthreads()
                for kk in range(DEC_K):
                    i = base + kk * nthr + tid
                    if i < n:
                        b = bucket_of(i, bs, inv_bs)
                        pj, lb, le, sb = locate(i, b, k, chunk, bpc, nch, pw, psoff, last_psoff)
                        code = code_at(words, pj * pw + HDR_WORDS, le)
                        val = decoded(code, sunit, b, bl0, scales, sb, lb)
                        if k == 0:
                            acc[kk] = val
                        else:
                            acc[kk] = acc[kk] + val
                if kind == DEC_QSGD:
                    cuda.syncthreads()     # the next payload (or chunk) overwrites the table
            for kk in range(DEC_K):
                i = base + kk * nthr + tid
                if i < n:
                    v = acc[kk]
                    if CHUNKS:
                        if check:
                            if sbad[bucket_of(i, bs, inv_bs) // bpc] != 0:
                                v = FNAN
                        elif serr[0] != 0:
                            v = FNAN
                    elif bad:
                        v = FNAN
                    out[i] = v
            c += cuda.gridDim.x

    return block_decode_multi


@cuda.jit
def k_header(payload, header):
    tid = cuda.threadIdx.x
    if tid < 64:
        payload[tid] = header_byte(header, tid)


@cuda.jit
def k_check(payload, status, expect, check_name):
    """One thread writes the header's error bits (``wire.ERROR_BITS``) to ``status[0]``, ORs them into ``status[1]``."""
    if cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x != 0:
        return
    err = hdr_err(payload, expect, check_name)
    status[0] = err
    status[1] = status[1] | err
