"""On a real GPU: CUDA kernels == NumPy reference, the torch-CUDA codec path, no recompilation, no
torch-level host synchronisation in encode / decode_into. Skipped without CUDA.

The cases cover both CUDA kernel paths (warp and general: ``numba_kernels.cuda.kernel_path``), each
configuration taking the one it selects; encodes also write the residual (in place) and decodes
check the header (``expect``) in the kernel.

Also runnable without pytest on a GPU machine: ``python tests/test_codec_gpu.py`` prints one line per
check and exits non-zero on a failure.
"""
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import KEY_FUSED, chunk_payloads, make_x, onebit_payloads, qsgd_payloads  # noqa: E402

try:
    import pytest
except ImportError:          # the GPU machines may have no pytest: run as a script
    pytest = None


def _cuda_ok():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def op(method, kind, numel, device=True, **params):
    """The prepared op of one call (``numba_kernels.prepare``), on the device."""
    import numba_kernels
    return numba_kernels.prepare(method, kind, device, numel, **params)


def _nan_eq(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
        np.where(np.isnan(a), 0, a).view(np.uint32), np.where(np.isnan(b), 0, b).view(np.uint32)))




BUCKET_SIZES = (1, 7, 64, 96, 256, 352, 512, 10000)


def check_kernels_match_reference():
    """The cases of ``kernels_match_reference_part``, one process per bucket size (and one for the
    rest) at once: each part compiles its own kernel specialisations (several hundred in all, a
    second or two each), which in one process took longer than a 10-minute call of the device tool."""
    import subprocess
    parts = [str(bs) for bs in BUCKET_SIZES] + ["rest"]
    procs = {part: subprocess.Popen([sys.executable, __file__, "--part", part], stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True) for part in parts}
    fails = []
    for part, proc in procs.items():
        out, _ = proc.communicate()
        fails += [line[len("FAIL "):] for line in out.splitlines() if line.startswith("FAIL ")]
        if proc.returncode or f"PART {part} DONE" not in out:
            fails.append(f"part {part} exited {proc.returncode}: {out[-2000:]}")
    return fails


def kernels_match_reference_part(bucket_sizes, rest):
    """Every size around groups/lanes/buckets, every bit width, both roundings and norms, 1-bit, for
    the given bucket sizes (including buckets above FUSE_MAX: the general path's two-kernel encode);
    with ``rest``, a decode grid striding over more bucket groups than fit at once and the header
    check folded into the decode."""
    from numba import cuda
    import numba_kernels.cuda as K
    from numba_kernels import reference as R, wire
    fails = []
    rng = np.random.default_rng(0)
    key = 0x1234_5678_9ABC_DEF0
    sizes = (0, 1, 7, 8, 9, 31, 32, 33, 255, 256, 257, 511, 512, 513, 1000, 4097, 100_003)
    # then magnitudes over the whole float32 range: v3's division for tiny quotients and extreme scales
    for n, wide in [(n, False) for n in sizes] + [(1000, True), (100_003, True)]:
        if wide:
            x = make_x(n, n, wide=True)
        else:
            x = (rng.standard_normal(n) * np.exp(rng.standard_normal(n) * 2)).astype(np.float32)
        if n > 20:
            x[rng.integers(0, n, 3)] = [np.nan, np.inf, 0.0]
        xd = cuda.to_device(x)
        for bs in bucket_sizes:
            for bits in ((2, 3, 4, 5, 8, 12, 16) if bs != 10000 else (3, 4)):
                for st in (True, False):
                    for l2 in (False, True):
                        h = wire.Header(2, bits, 0 if st else 1, int(l2), bs, 0, (n,)).words()
                        lay = wire.layout(2, n, bits, bs)
                        want = np.zeros(lay.total, np.uint8)
                        rref = np.empty(n, np.float32)
                        with np.errstate(all="ignore"):
                            R.qsgd_encode_ref(x, want, h, bits, bs, st, l2, key, residual=rref)
                        d = cuda.to_device(np.full(lay.total, 0xA5, np.uint8))
                        resid = (n + bits + bs) % 3 == 0        # a third of the cases: in place
                        xr = cuda.to_device(x) if resid else None
                        op("qsgd", "encode", (xr if resid else xd).size, bits=bits, bucket_size=bs,
                           stochastic=st, norm_l2=l2, device=True)(
                            xr if resid else xd, d, h, key, 0, xr)
                        got = d.copy_to_host()
                        sc = slice(lay.scales_offset, lay.total)
                        ok = np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset]) and _nan_eq(
                            want[sc].view(np.float32), got[sc].view(np.float32))
                        if resid and not _nan_eq(rref, xr.copy_to_host()):
                            fails.append(f"qsgd residual n={n} bs={bs} bits={bits} st={st} l2={l2}")
                        a = np.ones(n, np.float32)
                        with np.errstate(all="ignore"):
                            R.qsgd_decode_ref(want, a, bits, bs, True)
                        o = cuda.to_device(np.ones(n, np.float32))
                        op("qsgd", "decode", o.size, bits=bits, bucket_size=bs, accumulate=True, device=True)(
                            cuda.to_device(want), o)
                        if not (ok and _nan_eq(a, o.copy_to_host())):
                            fails.append(f"qsgd n={n}{' wide' if wide else ''} bs={bs} bits={bits} st={st} "
                                         f"l2={l2} enc={ok}")
            for bs1 in (0, bs):
                for tm in (True, False):
                    mode = 0 if tm else 1
                    h = wire.Header(3, 1, mode, 0, bs1, 0, (n,)).words()
                    lay = wire.layout(3, n, 1, bs1, mode)
                    want = np.zeros(lay.total, np.uint8)
                    rref = np.empty(n, np.float32)
                    with np.errstate(all="ignore"):
                        R.onebit_encode_ref(x, want, h, bs1, tm, residual=rref)
                    d = cuda.to_device(np.full(lay.total, 0xA5, np.uint8))
                    rd = cuda.device_array(n, np.float32)
                    op("onebit", "encode", xd.size, bucket_size=bs1, two_mean=tm, device=True)(
                        xd, d, h, 0, 0, rd)
                    if not _nan_eq(rref, rd.copy_to_host()):
                        fails.append(f"onebit residual n={n} bs={bs1} two_mean={tm}")
                    got = d.copy_to_host()
                    sc = slice(lay.scales_offset, lay.total)
                    ok = np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset]) and _nan_eq(
                        want[sc].view(np.float32), got[sc].view(np.float32))
                    a = np.ones(n, np.float32)
                    with np.errstate(all="ignore"):
                        R.onebit_decode_ref(want, a, bs1, tm, False)
                    o = cuda.to_device(np.ones(n, np.float32))
                    op("onebit", "decode", o.size, bucket_size=bs1, two_mean=tm, accumulate=False, device=True)(
                        cuda.to_device(want), o)
                    if not (ok and _nan_eq(a, o.copy_to_host())):
                        fails.append(f"onebit n={n}{' wide' if wide else ''} bs={bs1} two_mean={tm} enc={ok}")
    if not rest:
        return fails
    # the warp path's persistent decode grid strides over more bucket groups than fit at once
    n = 5_000_000
    x = rng.standard_normal(n).astype(np.float32)
    xd = cuda.to_device(x)
    for bits, bs, st, l2 in ((4, 64, True, False), (8, 512, False, True), (2, 32, True, True)):
        h = wire.Header(2, bits, 0 if st else 1, int(l2), bs, 0, (n,)).words()
        lay = wire.layout(2, n, bits, bs)
        want = np.zeros(lay.total, np.uint8)
        R.qsgd_encode_ref(x, want, h, bits, bs, st, l2, key)
        d = cuda.to_device(np.full(lay.total, 0xA5, np.uint8))
        op("qsgd", "encode", xd.size, bits=bits, bucket_size=bs, stochastic=st, norm_l2=l2, device=True)(
            xd, d, h, key)
        a = np.zeros(n, np.float32)
        R.qsgd_decode_ref(want, a, bits, bs, False)
        o = cuda.to_device(np.ones(n, np.float32))
        op("qsgd", "decode", o.size, bits=bits, bucket_size=bs, accumulate=False, device=True)(d, o)
        if not (np.array_equal(want, d.copy_to_host()) and _nan_eq(a, o.copy_to_host())):
            fails.append(f"qsgd n={n} bs={bs} bits={bits} st={st} l2={l2}")
    # header check inside the decode (expect) and standalone, good and bad, status as the reference says
    h = wire.Header(2, 4, 0, 0, 64, 0, (100_003,), name_hash=wire.name_hash("w"))
    lay = wire.layout(2, 100_003, 4, 64)
    p = np.zeros(lay.total, np.uint8)
    R.qsgd_encode_ref(rng.standard_normal(100_003).astype(np.float32), p, h.words(), 4, 64, True, False, key)
    for exp in ((2, 4, 0, 0, 64, 100_003, wire.name_hash("w"), True),
                (2, 8, 1, 1, 128, 100_004, wire.name_hash("v"), True),
                (2, 4, 0, 0, 64, 100_003, 0, False)):
        for how in ("expect", "check"):
            status = cuda.to_device(np.array([0, 4096], np.int32))
            dq = cuda.to_device(p)
            o = cuda.to_device(np.zeros(100_003, np.float32))
            if how == "check":
                K.check_header_cuda(dq, status, wire.Expect(*exp))
                op("qsgd", "decode", o.size, bits=4, bucket_size=64, accumulate=False, device=True)(
                    dq, o, 0, status)
            else:
                op("qsgd", "decode", o.size, bits=4, bucket_size=64, accumulate=False, device=True)(
                    dq, o, 0, status, wire.Expect(*exp))
            want = R.header_errors_ref(p, *exp)
            st = status.copy_to_host()
            y = o.copy_to_host()
            if not (int(st[0]) == want and int(st[1]) == want | 4096
                    and (bool(np.isnan(y).all()) if want else not np.isnan(y).any())):
                fails.append(f"header {how} {exp}: status {st.tolist()}, want {want}")
    return fails


def check_sort_kmeans_kernels_match_reference():
    """SortQuant (block-per-bucket sort, up to its 4096 limit) and KMeans (sampled starts above 1024
    values, tiles of 4096 per block, one codebook per tensor over many blocks, 1 to 8 bits): bytes,
    in-place residuals and checked decodes equal to the reference, and another tensor's payload
    refused (NaN, status bit 256)."""
    from numba import cuda
    from numba_kernels import reference as R, wire
    fails = []
    key = 0x1234_5678_9ABC_DEF0

    def case(label, x, method, lay, h, encode_ref, encode_cuda, decode_ref, decode_cuda, expect):
        want = np.zeros(lay.total, np.uint8)
        rref = np.empty(x.size, np.float32)
        with np.errstate(all="ignore"):
            encode_ref(x, want, h, rref)
        d = cuda.to_device(np.full(lay.total, 0xA5, np.uint8))
        xr = cuda.to_device(x)
        encode_cuda(xr, d, h, xr)
        got = d.copy_to_host()
        sc = slice(lay.scales_offset, lay.total)
        if not (np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset])
                and _nan_eq(want[sc].view(np.float32), got[sc].view(np.float32))
                and _nan_eq(rref, xr.copy_to_host())):
            fails.append(f"{label}: encode")
        a = np.ones(x.size, np.float32)
        with np.errstate(all="ignore"):
            decode_ref(want, a)
        o = cuda.to_device(np.ones(x.size, np.float32))
        status = cuda.to_device(np.zeros(2, np.int32))
        decode_cuda(cuda.to_device(want), o, status, expect)
        if not (_nan_eq(a, o.copy_to_host()) and int(status.copy_to_host()[0]) == 0):
            fails.append(f"{label}: decode")
        if x.size:
            o = cuda.to_device(np.zeros(x.size, np.float32))
            decode_cuda(cuda.to_device(want), o, status, expect._replace(name_hash=expect.name_hash + 1))
            if not (np.isnan(o.copy_to_host()).all() and int(status.copy_to_host()[0]) == 256):
                fails.append(f"{label}: another tensor's payload not refused")

    for n in (0, 1, 9, 513, 4097, 100_003, 1_000_003):
        for special in (False, True):
            x = make_x(n, n + 3, special=special and n > 20)
            if n > 40:
                x[10:30] = x[5]
            for bs, bits, sb, st in ((7, 4, 2, True), (512, 4, 2, True), (4096, 8, 2, False), (100, 16, 4, True)):
                if n > 100_003 and bs != 512:
                    continue
                mode = 0 if st else 1
                h = wire.Header(4, bits, mode, sb, bs, 0, (n,), name_hash=7).words()
                case(f"sortquant n={n} bs={bs} bits={bits}/{sb} st={st} special={special}", x, 4,
                     wire.layout(4, n, bits, bs, 0, sb), h,
                     lambda x_, p, h_, r: R.sortquant_encode_ref(x_, p, h_, bits, sb, bs, st, key, residual=r),
                     lambda x_, p, h_, r: op("sortquant", "encode", x_.size, bits=bits, split_bits=sb,
                                             bucket_size=bs, stochastic=st, device=True)(
                         x_, p, h_, key, 0, r),
                     lambda p, a: R.sortquant_decode_ref(p, a, bits, sb, bs, True),
                     lambda p, o, s_, e: op("sortquant", "decode", o.size, bits=bits, split_bits=sb,
                                            bucket_size=bs, accumulate=True, device=True)(
                         p, o, 0, s_, e),
                     wire.Expect(4, bits, mode, sb, bs, n, 7, True))
            for bs, bits, iters in ((0, 4, 20), (0, 1, 5), (0, 8, 3), (7, 3, 4), (512, 2, 20), (5000, 5, 6)):
                if n > 100_003 and bs not in (0, 512):
                    continue
                h = wire.Header(5, bits, 0, 0, bs, 0, (n,), name_hash=7).words()
                case(f"kmeans n={n} bs={bs} bits={bits} iters={iters} special={special}", x, 5,
                     wire.layout(5, n, bits, bs), h,
                     lambda x_, p, h_, r: R.kmeans_encode_ref(x_, p, h_, bits, bs, iters, key, residual=r),
                     lambda x_, p, h_, r: op("kmeans", "encode", x_.size, bits=bits, bucket_size=bs,
                                             iters=iters, device=True)(
                         x_, p, h_, key, 0, r),
                     lambda p, a: R.kmeans_decode_ref(p, a, bits, bs, True),
                     lambda p, o, s_, e: op("kmeans", "decode", o.size, bits=bits, bucket_size=bs,
                                            accumulate=True, device=True)(
                         p, o, 0, s_, e),
                     wire.Expect(5, bits, 0, 0, bs, n, 7, True))
    return fails


def check_fused_kernels_match_reference():
    """decode_sum, reduce_requantize (with and without residual) and decode_chunks == reference, for
    n = 1 and 3 payloads, sizes on either side of the decode chunk (2048 elements), configurations the
    single-payload kernels send down either path, buckets above FUSE_MAX; a bad payload -> NaN and
    status bits."""
    from numba import cuda
    from numba_kernels import reference as R
    fails = []
    dev = cuda.to_device

    def penc(want, got, lay):
        sc = slice(lay.scales_offset, lay.total)
        return bool(np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset])
                    and _nan_eq(want[sc].view(np.float32), got[sc].view(np.float32)))

    for m in (0, 1, 2047, 2048, 2049, 100_003):
        for n in (1, 3):
            for bits, bs, st, l2 in ((4, 64, True, False), (2, 512, False, True), (3, 7, True, True),
                                     (8, 96, True, False), (4, 10000, False, False), (16, 32, True, True)):
                what = f"qsgd m={m} n={n} bits={bits} bs={bs} st={st} l2={l2}"
                buf, h, lay, exp = qsgd_payloads(n, m, bits, bs, st, l2, special=m > 100)
                a = np.empty(m, np.float32)
                with np.errstate(all="ignore"):
                    R.qsgd_decode_sum_ref(buf, n, a, bits, bs)
                o = dev(np.ones(m, np.float32))
                op("qsgd", "decode_sum", o.size, bits=bits, bucket_size=bs, device=True)(
                    dev(buf), n, o, 0, None, exp)
                if not _nan_eq(a, o.copy_to_host()):
                    fails.append(f"decode_sum {what}")
                for resid in (False, True):
                    r0 = make_x(m, 3)
                    ra = r0.copy() if resid else None
                    pa = np.zeros(lay.total, np.uint8)
                    with np.errstate(all="ignore"):
                        R.qsgd_reduce_requantize_ref(buf, n, ra, pa, h, bits, bs, st, l2, KEY_FUSED)
                    rd = dev(r0) if resid else None
                    pd = dev(np.full(lay.total, 0xA5, np.uint8))
                    op("qsgd", "reduce_requantize", int(h[2]), bits=bits, bucket_size=bs, stochastic=st,
                       norm_l2=l2, device=True)(
                        dev(buf), n, rd, pd, h, KEY_FUSED, 0, None, exp)
                    if not penc(pa, pd.copy_to_host(), lay) or (resid and not _nan_eq(ra, rd.copy_to_host())):
                        fails.append(f"reduce_requantize resid={resid} {what}")
                if m and bs < 10000:
                    chunk = bs * max(1, (m // bs) // 5)
                    g, nh, cexp = chunk_payloads(m, chunk, bits, bs, st, l2, special=True)
                    with np.errstate(all="ignore"):
                        R.qsgd_decode_chunks_ref(g, a, bits, bs, chunk)
                    o = dev(np.ones(m, np.float32))
                    status = dev(np.zeros(2, np.int32))
                    op("qsgd", "decode_chunks", o.size, bits=bits, bucket_size=bs, chunk=chunk, device=True)(
                        dev(g), o, 0, status, dev(nh), cexp)
                    if not _nan_eq(a, o.copy_to_host()) or status.copy_to_host().any():
                        fails.append(f"decode_chunks chunk={chunk} {what}")
                if m > 100 and n == 3:
                    other, _, _, _ = qsgd_payloads(1, m, bits, bs, st, l2, name="v")
                    bad = buf.copy()        # the last payload: a kernel's slice of a payload past
                    bad[2 * lay.total:] = other     # the second once read the second's header
                    status = dev(np.zeros(2, np.int32))
                    o = dev(np.ones(m, np.float32))
                    op("qsgd", "decode_sum", o.size, bits=bits, bucket_size=bs, device=True)(
                        dev(bad), n, o, 0, status, exp)
                    if not (np.isnan(o.copy_to_host()).all() and status.copy_to_host()[0] == 256):
                        fails.append(f"decode_sum bad payload {what}")
            for bs, tm in ((0, True), (0, False), (64, True), (7, False)):
                what = f"onebit m={m} n={n} bs={bs} two_mean={tm}"
                buf, h, lay, exp = onebit_payloads(n, m, bs, tm, special=m > 100)
                a = np.empty(m, np.float32)
                with np.errstate(all="ignore"):
                    R.onebit_decode_sum_ref(buf, n, a, bs, tm)
                o = dev(np.ones(m, np.float32))
                op("onebit", "decode_sum", o.size, bucket_size=bs, two_mean=tm, device=True)(
                    dev(buf), n, o, 0, None, exp)
                if not _nan_eq(a, o.copy_to_host()):
                    fails.append(f"decode_sum {what}")
                r0 = make_x(m, 3)
                ra = r0.copy()
                pa = np.zeros(lay.total, np.uint8)
                with np.errstate(all="ignore"):
                    R.onebit_reduce_requantize_ref(buf, n, ra, pa, h, bs, tm)
                rd = dev(r0)
                pd = dev(np.full(lay.total, 0xA5, np.uint8))
                op("onebit", "reduce_requantize", int(h[2]), bucket_size=bs, two_mean=tm, device=True)(
                    dev(buf), n, rd, pd, h, 0, 0, None, exp)
                if not (penc(pa, pd.copy_to_host(), lay) and _nan_eq(ra, rd.copy_to_host())):
                    fails.append(f"reduce_requantize {what}")
                if m:
                    chunk = bs * max(1, (m // bs) // 5) if bs else m
                    g, nh, cexp = chunk_payloads(m, chunk, 1, bs, False, False, two_mean=tm, special=True)
                    with np.errstate(all="ignore"):
                        R.onebit_decode_chunks_ref(g, a, bs, tm, chunk)
                    o = dev(np.ones(m, np.float32))
                    op("onebit", "decode_chunks", o.size, bucket_size=bs, two_mean=tm, chunk=chunk,
                       device=True)(
                        dev(g), o, 0, None, dev(nh))
                    if not _nan_eq(a, o.copy_to_host()):
                        fails.append(f"decode_chunks chunk={chunk} {what}")
    return fails


def check_torch_codec_path():
    """torch CUDA payloads == host payloads (same seed), decode/decode_into, bad payloads -> NaN +
    status, no torch host sync in encode/decode_into/decode(shape=...), no recompilation."""
    import torch
    import hvd_quant as hq
    import numba_kernels.cuda as K
    fails = []
    clean = torch.randn(3, 1000, device="cuda")
    x = clean.clone()
    x[1, 5] = float("nan")          # payload bytes may then differ in NaN bits only: compare decodes
    specs = ["qsgd:bits=4,bucket_size=512,seed=1", "qsgd:bits=8,bucket_size=7,mode=deterministic,norm=l2",
             "qsgd:bits=2,bucket_size=128,mode=fake,seed=2", "onebit:bucket_size=64", "onebit:scale=mean_abs",
             "sortquant:bits=4,split_bits=2,bucket_size=512,seed=1", "kmeans:bits=4,iters=20",
             "kmeans:bits=3,iters=5,bucket_size=512", "fp16", "none"]
    for spec in specs:
        host, dev = hq.from_spec(spec), hq.from_spec(spec)
        pc = dev.encode(clean, name="w")
        if not (pc.is_cuda and pc.dtype == torch.uint8
                and np.array_equal(host.encode(clean.cpu(), name="w").numpy(), pc.cpu().numpy())):
            fails.append(f"{spec}: device payload != host payload")
        host, dev = hq.from_spec(spec), hq.from_spec(spec)     # new objects: their counts restart
        ph = host.encode(x.cpu(), name="w")
        pd = dev.encode(x, name="w")
        yh = host.decode(ph)
        yd = dev.decode(pd)
        if not (yd.is_cuda and yd.shape == x.shape and _nan_eq(yh.numpy(), yd.cpu().numpy())):
            fails.append(f"{spec}: decode differs")
        yd2 = dev.decode(pd, name="w", shape=(3, 1000), dtype=torch.float32)
        if not _nan_eq(yh.numpy(), yd2.cpu().numpy()):
            fails.append(f"{spec}: decode(shape=...) differs")
        acc = torch.ones(3000, device="cuda")
        dev.decode_into(pd, acc, accumulate=True, name="w")
        acc_h = torch.ones(3000)
        host.decode_into(ph, acc_h, accumulate=True)
        if not _nan_eq(acc_h.numpy(), acc.cpu().numpy()):
            fails.append(f"{spec}: decode_into accumulate differs")
        try:
            dev.check_device_errors()
        except hq.PayloadError as e:
            fails.append(f"{spec}: spurious device error {e}")
        out = torch.zeros(3000, device="cuda")
        dev.decode_into(pd, out, name="other")
        try:
            dev.check_device_errors()
            fails.append(f"{spec}: wrong name not reported")
        except hq.PayloadError:
            pass
        if not bool(torch.isnan(out).all()):
            fails.append(f"{spec}: wrong-name decode did not write NaN")
        # bf16 / fp16 inputs come back in their dtype
        for dt in (torch.float16, torch.bfloat16):
            y = dev.decode(dev.encode(x.to(dt)))
            if y.dtype != dt or y.shape == ():
                fails.append(f"{spec}: {dt} round trip")
        # no torch-level synchronisation in the steady state
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            p = dev.encode(x, name="w")
            dev.decode_into(p, acc, accumulate=True, name="w")
            dev.decode(p, name="w", shape=(3, 1000), dtype=torch.float32)
        except RuntimeError as e:
            fails.append(f"{spec}: host synchronisation: {e}")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    counts = {k: len(v.overloads) for k, v in K.kernels.items()}
    c = hq.QSGD(bits=4, bucket_size=512)
    big = torch.randn(1 << 20, device="cuda")
    out = torch.empty_like(big)
    for _ in range(3):
        c.decode_into(c.encode(big), out)
    hq.OneBit(bucket_size=512).decode_into(hq.OneBit(bucket_size=512).encode(big), out)
    after = {k: len(v.overloads) for k, v in K.kernels.items()}
    # new configurations build new kernels; no kernel may gain a second signature
    if any(after[k] != counts[k] for k in counts) or any(v != 1 for v in after.values()):
        fails.append(f"recompiled: {counts} -> {after}")
    print("compiled signatures per kernel:", after)
    return fails


def check_threads_on_streams():
    """Two threads, each with its own equal codec and its own CUDA stream, encode and decode other
    tensors through the public API at once: every payload and decoded value is the one that thread's
    calls give alone (warp and general paths, one bucket per tensor, long buckets, SortQuant, KMeans)."""
    import threading
    import torch
    import hvd_quant as hq
    specs = ["qsgd:bits=3,bucket_size=512,seed=7", "onebit", "qsgd:bits=4,bucket_size=512,seed=7",
             "qsgd:bits=8,bucket_size=128,mode=deterministic", "onebit:bucket_size=64",
             "qsgd:bits=4,bucket_size=10000,seed=3", "sortquant:bits=4,split_bits=2,bucket_size=512,seed=1",
             "kmeans:bits=3,iters=5,bucket_size=512"]
    calls = 200
    gens = [torch.Generator(device="cuda").manual_seed(t) for t in range(2)]
    xs = [[torch.randn(int(n), device="cuda", generator=gens[t])
           for n in torch.randint(1, 300000, (calls,), generator=torch.Generator().manual_seed(t))]
          for t in range(2)]
    streams = [torch.cuda.Stream() for _ in range(2)]

    def run(codec, t):
        out = []
        with torch.cuda.stream(streams[t]):
            for x in xs[t]:
                p = codec.encode(x, name="w")
                y = torch.ones_like(x)
                codec.decode_into(p, y, accumulate=True, name="w")
                out.append((p, y))
        streams[t].synchronize()
        return [(p.cpu().numpy(), y.cpu().numpy()) for p, y in out]
    torch.cuda.synchronize()
    fails = []
    for spec in specs:
        alone = [run(hq.from_spec(spec), t) for t in range(2)]
        got, start = [None, None], threading.Barrier(2)

        def work(t):
            start.wait()
            got[t] = run(hq.from_spec(spec), t)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        try:
            hq.from_spec(spec).check_device_errors()
        except hq.PayloadError as e:
            fails.append(f"{spec}: {e}")
        for t in range(2):
            if got[t] is None:
                fails.append(f"{spec}: thread {t} raised")
                continue
            bad = [k for k, ((pa, ya), (pb, yb)) in enumerate(zip(got[t], alone[t]))
                   if not (np.array_equal(pa, pb) and _nan_eq(ya, yb))]
            if bad:
                fails.append(f"{spec}: thread {t}: {len(bad)} of {calls} calls differ from alone")
    return fails


CHECKS = {"kernels_match_reference": check_kernels_match_reference,
          "fused_kernels_match_reference": check_fused_kernels_match_reference,
          "sort_kmeans_kernels_match_reference": check_sort_kmeans_kernels_match_reference,
          "torch_codec_path": check_torch_codec_path, "threads_on_streams": check_threads_on_streams}


def run_check(name):
    return CHECKS[name]()


if pytest is not None:
    @pytest.mark.gpu
    @pytest.mark.torch
    @pytest.mark.skipif(not _cuda_ok(), reason="needs a CUDA GPU")
    @pytest.mark.parametrize("name", sorted(CHECKS))
    def test_gpu(name):
        fails = run_check(name)
        assert not fails, fails[:20]


if __name__ == "__main__":
    import time
    if sys.argv[1:2] == ["--part"]:       # one part of kernels_match_reference (it starts these)
        part = sys.argv[2]
        rest = part == "rest"
        for f in kernels_match_reference_part(() if rest else (int(part),), rest):
            print("FAIL", f)
        print(f"PART {part} DONE")
        sys.exit(0)
    bad = 0
    for name in CHECKS:
        t0 = time.time()
        try:
            fails = run_check(name)
        except Exception as e:      # a crash is a failure of this check, the others still run
            import traceback
            traceback.print_exc()
            fails = [f"raised {type(e).__name__}: {e}"]
        bad += len(fails)
        print(f"{name}: {'OK' if not fails else 'FAILED'} ({time.time() - t0:.1f} s)")
        for f in fails[:30]:
            print("   ", f)
    print("ALL OK" if not bad else f"{bad} FAILURE(S)")
    sys.exit(1 if bad else 0)
