"""The codecs' device path (CUDA kernels, on-device header checks, NaN on a bad payload, device error
status) in the CUDA simulator, through a tiny test-only device adapter over simulated device arrays.

Runs in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (set before ``numba.cuda`` is imported). Each case
is reported back and checked here by name. The child also holds the kernels themselves equal to the
NumPy reference (payload, decode, and the residual written in place by the encode) on cases chosen
for both kernel paths (warp: bit widths dividing 32, buckets of 32 or more elements, partial last
steps and buckets; general: fused encode with several buckets per block and odd bucket sizes, the
reduce + pack-only encode for buckets above ``FUSE_MAX`` over several pack blocks, straddling code
words for odd bit widths), and the header check run inside the decode (``expect``) or by the
standalone check kernel. The torch-CUDA adapter itself needs a GPU
(``HVDQ_REAL_CUDA=1`` on a GPU machine runs tests/test_kernels.py's child on the real device; the
GPU run recorded in docs/BENCHMARKS.md exercised the torch path).
"""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]

CODECS = ["qsgd:bits=4,bucket_size=16,seed=3", "qsgd:bits=8,bucket_size=7,mode=deterministic,norm=l2",
          "qsgd:bits=2,bucket_size=32,mode=fake,seed=1", "onebit:bucket_size=16", "onebit:scale=mean_abs",
          "qsgd:bits=4,bucket_size=32,seed=5", "qsgd:bits=8,bucket_size=64,norm=l2,seed=2",
          "onebit:bucket_size=32", "fp16", "none"]
KERNEL_QSGD = [(0, 7, 4, True, False), (1, 7, 2, True, True), (9, 7, 3, False, False),
               (33, 64, 5, True, True), (33, 1, 16, False, True), (100, 64, 8, True, False),
               (100, 7, 12, False, True), (300, 16, 4, True, False), (300, 9000, 3, True, True),
               (70, 3, 7, True, False),
               # general path, buckets above FUSE_MAX over several pack-only blocks
               (3000, 9000, 3, True, True), (2500, 10000, 5, False, False),
               # v3 (warp per bucket): bits dividing 32, buckets of >= 32 elements holding whole words
               # (the kernel follows bits, bucket and scale, not the length: lengths above 300, for
               # plain data only, with a partial last bucket)
               (310, 96, 4, True, True), (257, 32, 2, False, False), (130, 64, 16, True, False),
               (600, 512, 8, True, False), (65, 40, 4, False, True), (700, 640, 4, True, False),
               (300, 128, 4, True, False),
               # v3's word assembly by recursive halving (steps in registers >= codes per word)
               (301, 256, 4, True, False), (600, 512, 2, True, True), (300, 128, 8, False, False),
               (400, 352, 4, True, True)]
KERNEL_ONEBIT = [(0, 64, True), (1, 0, True), (33, 7, False), (100, 0, False), (100, 64, True),
                 (70, 1, True), (200, 9000, False), (300, 96, False), (100, 32, True), (3000, 0, True),
                 (5000, 0, False)]


def _variants(n):
    """Plain, special-valued and wide-range inputs; above 300 elements (slow in the simulator, and the
    data variants run on the same kernels at the smaller sizes) plain only."""
    return ("", "-special", "-wide") if n <= 300 else ("",)


KERNEL_CASES = ([f"qsgd-n{n}-bs{bs}-b{b}-{'stoch' if st else 'det'}-{'l2' if l2 else 'max'}{sp}"
                 for n, bs, b, st, l2 in KERNEL_QSGD for sp in _variants(n)]
                + [f"onebit-n{n}-bs{bs}-{'two_mean' if tm else 'mean_abs'}" for n, bs, tm in KERNEL_ONEBIT]
                + ["expect-bad", "expect-good", "check-then-decode", "check-raw-method", "expect-empty"])
CHECKS = ["encode-bytes", "decode-header-read", "decode-shape-given", "decode-into-accumulate",
          "bad-config-nan-and-status", "bad-name-nan-and-status", "wrong-size-raises",
          "numel-mismatch-detected", "clean-status"]


class SimTensor:
    """A 'device tensor' for tests: a simulated Numba device array plus a dtype label and shape."""

    def __init__(self, dev, shape=None):
        self.dev = dev
        self.shape = tuple(dev.shape) if shape is None else tuple(shape)


def adapter(obj):
    return _ADAPTER[0]


_ADAPTER = [None]


def _make_adapter():
    from numba import cuda
    from hvd_quant._arrays import DeviceAdapter

    class SimAdapter(DeviceAdapter):
        kind = "sim"

        def describe(self, x):
            return x.shape, "float32"

        def device_key(self, x):
            return ("sim", 0)

        def stream(self, x):
            return 0

        def context(self, x):
            return contextlib.nullcontext()

        def input_f32(self, x):
            return x, x.dev.reshape(-1)

        def new_bytes(self, n, like):
            d = cuda.to_device(np.full(n, 0xA5, np.uint8))
            return SimTensor(d), d

        def new_f32(self, n, like):
            d = cuda.to_device(np.full(n, np.float32(123.0)))
            return SimTensor(d), d

        def new_status(self, like):
            d = cuda.to_device(np.zeros(2, np.int32))
            return SimTensor(d), d

        def bytes_dev(self, payload):
            return payload.dev

        def numba(self, t):
            return t.dev

        def payload_nbytes(self, payload):
            return payload.dev.size

        def numel(self, t):
            return t.dev.size

        def out_dev(self, out):
            return out.dev, None

        def read_header(self, payload):
            return payload.dev.copy_to_host()[:64]

        def read_status(self, status):
            st = status.dev.copy_to_host()
            bits = int(st[1])
            if bits:
                st[1] = 0
                status.dev.copy_to_device(st)
            return bits

        def result(self, f32, dtype_name, shape):
            return SimTensor(f32.dev, shape)

        def raw_encode_into(self, x, value_dtype, payload):
            p = np.zeros(payload.dev.size, np.uint8)
            v = x.dev.copy_to_host().reshape(-1)
            p[64:64 + v.size * np.dtype(value_dtype).itemsize].view(value_dtype)[...] = v
            payload.dev.copy_to_device(p)
            return payload.dev

        def raw_decode_into(self, payload, offset, numel, value_dtype, out, accumulate, bad):
            w = np.dtype(value_dtype).itemsize
            vals = payload.dev.copy_to_host()[offset:offset + w * numel].view(value_dtype).astype(np.float32)
            o = out.dev.copy_to_host().reshape(-1)
            o = o + vals if accumulate else vals
            if bad is not None and bad.dev.copy_to_host()[0]:
                o[:] = np.nan
            out.dev.copy_to_device(o.reshape(out.dev.shape))

        def status_bad(self, status):
            return status

    return SimAdapter()


def _child():
    import warnings
    warnings.simplefilter("ignore")
    from numba import cuda
    import hvd_quant as hq
    from hvd_quant import _arrays
    _ADAPTER[0] = _make_adapter()
    _arrays.register_backend("tests", "tests.test_codec_cuda_sim")

    def nan_eq(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return bool(np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
            np.where(np.isnan(a), 0, a).view(np.uint32), np.where(np.isnan(b), 0, b).view(np.uint32)))

    import numba_kernels.cuda as K
    res = {"kernels": _kernel_cases(nan_eq)}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((10, 10)).astype(np.float32)
    x[3, 3] = np.nan
    for spec in CODECS:
        r = {}
        host, devc = hq.from_spec(spec), hq.from_spec(spec)
        ph = host.encode(x, name="w")
        xd = SimTensor(cuda.to_device(x))
        pd = devc.encode(xd, name="w")
        pbytes = pd.dev.copy_to_host()
        r["encode-bytes"] = bool(np.array_equal(ph, pbytes))
        yh = host.decode(ph)
        r["decode-header-read"] = nan_eq(yh, devc.decode(pd).dev.copy_to_host().reshape(10, 10))
        r["decode-shape-given"] = nan_eq(yh, devc.decode(pd, name="w", shape=(10, 10), dtype="float32")
                                         .dev.copy_to_host().reshape(10, 10))
        base = rng.standard_normal(100).astype(np.float32)
        acc_h = base.copy()
        host.decode_into(ph, acc_h, accumulate=True)
        acc_d = SimTensor(cuda.to_device(base.copy()))
        devc.decode_into(pd, acc_d, accumulate=True, name="w")
        ok = nan_eq(acc_h, acc_d.dev.copy_to_host())
        try:
            devc.check_device_errors()
        except hq.PayloadError:
            ok = False
        r["decode-into-accumulate"] = ok
        r["clean-status"] = ok
        # another configuration with the same payload size: the device check refuses it
        other = {"qsgd": "qsgd:bits=4,bucket_size=16,mode=deterministic",
                 "onebit": "onebit:bucket_size=16,scale=mean_abs" if "16" in spec else "onebit"}.get(
            spec.split(":")[0])
        if spec.startswith("onebit:scale"):
            other = "onebit:scale=two_mean"
        if other is not None and hq.from_spec(other).wire_nbytes(100) == devc.wire_nbytes(100) \
                and hq.from_spec(other) != devc:
            po = hq.from_spec(other).encode(xd, name="w")
            out = SimTensor(cuda.to_device(np.zeros(100, np.float32)))
            devc.decode_into(po, out, name="w")
            nan_all = bool(np.isnan(out.dev.copy_to_host()).all())
            try:
                devc.check_device_errors()
                raised = False
            except hq.PayloadError as e:
                raised = "differs" in str(e)
            r["bad-config-nan-and-status"] = nan_all and raised
        else:          # fp16/none: a payload of the other raw codec has another size
            r["bad-config-nan-and-status"] = True
        out = SimTensor(cuda.to_device(np.zeros(100, np.float32)))
        devc.decode_into(pd, out, name="v")
        nan_all = bool(np.isnan(out.dev.copy_to_host()).all())
        try:
            devc.check_device_errors()
            raised = False
        except hq.PayloadError as e:
            raised = "name hash" in str(e)
        r["bad-name-nan-and-status"] = nan_all and raised
        try:
            devc.decode_into(pd, SimTensor(cuda.to_device(np.zeros(50, np.float32))))
            r["wrong-size-raises"] = False
        except hq.PayloadError:
            r["wrong-size-raises"] = True
        # 99 elements may take the same bytes as 100 (padding): then the device check catches it
        out = SimTensor(cuda.to_device(np.zeros(99, np.float32)))
        try:
            devc.decode_into(pd, out)
            nan_all = bool(np.isnan(out.dev.copy_to_host()).all())
            try:
                devc.check_device_errors()
                r["numel-mismatch-detected"] = False
            except hq.PayloadError as e:
                r["numel-mismatch-detected"] = nan_all and "numel differs" in str(e)
        except hq.PayloadError:
            r["numel-mismatch-detected"] = True
        res[spec] = r
    res["compiled"] = sorted(K.kernels)
    json.dump(res, sys.stdout)


def _kernel_cases(nan_eq):
    """Kernels (both paths) == NumPy reference, and the header-check plumbing."""
    from numba import cuda
    import numba_kernels.cuda as K
    from numba_kernels import reference as R, wire
    from tests.test_kernels import KEY, make_x, onebit_case, qsgd_case
    out = {}
    dev = cuda.to_device
    for n, bs, bits, st, l2 in KERNEL_QSGD:
        for variant in _variants(n):
            x, h, lay = qsgd_case(n, bs, bits, st, l2, x=make_x(n, n + bs, variant == "-special",
                                                                variant == "-wide") if variant else None)
            want = np.zeros(lay.total, np.uint8)
            rref = np.empty(n, np.float32)
            with np.errstate(all="ignore"):
                R.qsgd_encode_ref(x, want, h, bits, bs, st, l2, KEY, residual=rref)
            d = dev(np.full(lay.total, 0xA5, np.uint8))
            xd = dev(x)
            K.qsgd_encode_cuda(xd, d, h, bits, bs, st, l2, KEY, residual=xd)
            got = d.copy_to_host()
            sc = slice(lay.scales_offset, lay.total)
            ok = np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset]) and nan_eq(
                want[sc].view(np.float32), got[sc].view(np.float32)) and nan_eq(rref, xd.copy_to_host())
            a = make_x(n, 5)
            o = dev(a.copy())
            with np.errstate(all="ignore"):
                R.qsgd_decode_ref(want, a, bits, bs, True)
            K.qsgd_decode_cuda(dev(want), o, bits, bs, True)
            name = f"qsgd-n{n}-bs{bs}-b{bits}-{'stoch' if st else 'det'}-{'l2' if l2 else 'max'}{variant}"
            out[name] = bool(ok) and nan_eq(a, o.copy_to_host())
    for n, bs, tm in KERNEL_ONEBIT:
        x, h, lay = onebit_case(n, bs, tm, special=n > 50)
        want = np.zeros(lay.total, np.uint8)
        rref = np.empty(n, np.float32)
        with np.errstate(all="ignore"):
            R.onebit_encode_ref(x, want, h, bs, tm, residual=rref)
        d = dev(np.full(lay.total, 0xA5, np.uint8))
        xd = dev(x)
        K.onebit_encode_cuda(xd, d, h, bs, tm, residual=xd)
        got = d.copy_to_host()
        sc = slice(lay.scales_offset, lay.total)
        ok = np.array_equal(want[:lay.scales_offset], got[:lay.scales_offset]) and nan_eq(
            want[sc].view(np.float32), got[sc].view(np.float32)) and nan_eq(rref, xd.copy_to_host())
        a = make_x(n, 5)
        o = dev(a.copy())
        with np.errstate(all="ignore"):
            R.onebit_decode_ref(want, a, bs, tm, False)
        K.onebit_decode_cuda(dev(want), o, bs, tm, False)
        out[f"onebit-n{n}-bs{bs}-{'two_mean' if tm else 'mean_abs'}"] = bool(ok) and nan_eq(a, o.copy_to_host())
    # header checks: inside the decode (expect) or by the check kernel before a decode (status)
    h = wire.Header(2, 4, 0, 0, 64, 0, (100,), name_hash=wire.name_hash("w"))
    p = np.zeros(wire.layout(2, 100, 4, 64).total, np.uint8)
    R.qsgd_encode_ref(make_x(100, 1), p, h.words(), 4, 64, True, False, KEY)
    good = wire.Expect(2, 4, 0, 0, 64, 100, wire.name_hash("w"), True)
    bad = wire.Expect(2, 8, 1, 1, 128, 101, wire.name_hash("v"), True)
    for name, exp in (("expect-bad", bad), ("expect-good", good)):
        status = dev(np.array([0, 4096], np.int32))
        dq = dev(p)
        o = dev(np.zeros(100, np.float32))
        K.qsgd_decode_cuda(dq, o, 4, 64, False, 0, status, exp)
        want = R.header_errors_ref(p, *exp)
        st = status.copy_to_host()
        y = o.copy_to_host()
        out[name] = (int(st[0]) == want and int(st[1]) == (want | 4096)
                     and (bool(np.isnan(y).all()) if want else not np.isnan(y).any()))
    status = dev(np.zeros(2, np.int32))
    dq = dev(p)
    K.check_header_cuda(dq, status, bad)
    o = dev(np.zeros(100, np.float32))
    K.qsgd_decode_cuda(dq, o, 4, 64, False, 0, status)       # no expect: reads status[0]
    out["check-then-decode"] = (int(status.copy_to_host()[0]) == R.header_errors_ref(p, *bad)
                                and bool(np.isnan(o.copy_to_host()).all()))
    status = dev(np.zeros(2, np.int32))
    K.check_header_cuda(dq, status, wire.Expect(1, 16, 0, 0, 0, 100))
    out["check-raw-method"] = (int(status.copy_to_host()[0])
                               == R.header_errors_ref(p, 1, 16, 0, 0, 0, 100, 0, False) != 0)
    # nothing to decode: the check still runs and reports
    h0 = wire.Header(2, 4, 0, 0, 64, 0, (0,))
    p0 = np.zeros(wire.layout(2, 0, 4, 64).total, np.uint8)
    R.qsgd_encode_ref(np.zeros(0, np.float32), p0, h0.words(), 4, 64, True, False, KEY)
    status = dev(np.zeros(2, np.int32))
    K.qsgd_decode_cuda(dev(p0), dev(np.zeros(0, np.float32)), 4, 64, False, 0, status,
                       wire.Expect(2, 4, 0, 0, 64, 0, 5, True))
    out["expect-empty"] = int(status.copy_to_host()[0]) == 256
    return out


@pytest.fixture(scope="module")
def results():
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", "import tests.test_codec_cuda_sim as t; t._child()"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("spec", CODECS)
def test_device_codec_path(results, spec, check):
    assert results[spec][check] is True


def test_both_kernel_paths_ran(results):
    """The cases above went through the kernels of both paths (warp: qsgd at 2, 4, 8, 16 bits with
    every scale, and 1-bit with both scales, buckets kept in registers (up to 512 elements) and re-read
    (above), paired hash draws, code words assembled by recursive halving (steps in registers >= codes
    per word), decodes of whole and partial buckets; general: its fused encode and decode, the reduce
    + pack-only encode), with and without residuals."""
    got = set(results["compiled"])
    # warp_encode_<bits>_<scale>_<pack>_<steps in registers: 0 = run-time loop>_<paired>_<residual>
    want = {"warp_encode_4_1_1_4_False_True", "warp_encode_2_0_0_1_False_True",
            "warp_encode_16_0_1_2_True_True", "warp_encode_8_0_1_2_True_True",
            "warp_encode_8_0_1_16_True_True", "warp_encode_4_1_0_2_False_True",
            "warp_encode_4_0_1_0_False_True", "warp_encode_4_0_1_4_True_True",
            
            "warp_encode_1_3_2_4_False_True", "warp_encode_1_2_2_1_False_True",
            "warp_encode_1_2_2_2_False_True", "warp_encode_4_0_1_8_True_True",
            "warp_encode_2_1_1_16_True_True", "warp_encode_8_0_0_4_False_True",
            "warp_encode_4_1_1_16_False_True",
            "warp_decode_4_0_4", "warp_decode_2_0_1", "warp_decode_16_0_2", "warp_decode_8_0_2",
            "warp_decode_8_0_16", "warp_decode_4_0_2", "warp_decode_4_0_0", "warp_decode_4_0_1",
            "warp_decode_4_0_8", "warp_decode_4_0_11", "warp_decode_2_0_16",
            "warp_decode_1_1_1", "warp_decode_1_1_2", "warp_decode_1_2_3",
            "block_encode_3_1_1_True", "block_encode_5_0_0_True", "block_encode_1_2_2_True",
            "block_encode_1_3_2_True", "block_encode_4_0_1_False", "block_decode_3_0",
            "block_decode_1_1", "reduce_1", "reduce_0", "check"}
    assert want <= got, sorted(want - got)


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_reference(results, case):
    assert results["kernels"].get(case) is True, case
