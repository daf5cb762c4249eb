"""The codecs' device path (CUDA kernels, on-device header checks, NaN on a bad payload, device error
status) in the CUDA simulator, through a tiny test-only device adapter over simulated device arrays.

Runs in a subprocess with ``NUMBA_ENABLE_CUDASIM=1`` (set before ``numba.cuda`` is imported), started
in the background at collection (tests/children.py); each case is reported back and checked here by
name. The kernels themselves against the NumPy reference: tests/test_kernels.py. The torch-CUDA
adapter itself needs a GPU (tests/test_codec_gpu.py).
"""
import contextlib
import json
import sys

import numpy as np
import pytest


CODECS = ["qsgd:bits=4,bucket_size=16,seed=3", "qsgd:bits=8,bucket_size=7,mode=deterministic,norm=l2",
          "qsgd:bits=2,bucket_size=32,mode=fake,seed=1", "onebit:bucket_size=16", "onebit:scale=mean_abs",
          "qsgd:bits=4,bucket_size=32,seed=5", "qsgd:bits=8,bucket_size=64,norm=l2,seed=2",
          "onebit:bucket_size=32", "sortquant:bits=4,split_bits=2,bucket_size=16,seed=3",
          "sortquant:bits=6,split_bits=3,bucket_size=40,mode=deterministic", "kmeans:bits=3,iters=4",
          "kmeans:bits=4,iters=2,bucket_size=24,seed=none", "fp16", "none"]
# per codec: a configuration whose payload of n elements has as many bytes as the codec's payload of
# 100 elements, and its n (the check "bad-config" feeds it to the codec's device decode)
OTHER = {"qsgd:bits=4,bucket_size=16,seed=3": ("qsgd:bits=4,bucket_size=16,mode=deterministic", 100),
         "qsgd:bits=8,bucket_size=7,mode=deterministic,norm=l2": ("qsgd:bits=8,bucket_size=7,mode=deterministic",
                                                                  100),
         "qsgd:bits=2,bucket_size=32,mode=fake,seed=1": ("none", 100),
         "onebit:bucket_size=16": ("onebit:bucket_size=15", 100),
         "onebit:scale=mean_abs": ("onebit:bucket_size=100,scale=mean_abs", 100),
         "qsgd:bits=4,bucket_size=32,seed=5": ("qsgd:bits=4,bucket_size=32,mode=deterministic", 100),
         "qsgd:bits=8,bucket_size=64,norm=l2,seed=2": ("qsgd:bits=8,bucket_size=64,seed=2", 100),
         "onebit:bucket_size=32": ("onebit:bucket_size=26", 100),
         "sortquant:bits=4,split_bits=2,bucket_size=16,seed=3":
             ("sortquant:bits=4,split_bits=2,bucket_size=16,mode=deterministic", 100),
         "sortquant:bits=6,split_bits=3,bucket_size=40,mode=deterministic":
             ("sortquant:bits=6,split_bits=3,bucket_size=40", 100),
         "kmeans:bits=3,iters=4": ("kmeans:bits=3,iters=4,bucket_size=100", 100),
         "kmeans:bits=4,iters=2,bucket_size=24,seed=none": ("kmeans:bits=4,iters=2,bucket_size=21", 100),
         "fp16": ("none", 50), "none": ("fp16", 200)}
CHECKS = ["encode-bytes", "decode-header-read", "decode-shape-given", "decode-into-accumulate",
          "bad-config-nan-and-status", "bad-name-nan-and-status", "wrong-size-raises",
          "numel-mismatch-detected", "clean-status"]
# "threads" (most of the child's time) on one codec per kernel family and path: QSGD's general and
# warp kernels, 1-bit's (one bucket per tensor, and the warp path), SortQuant, KMeans, the raw path
THREADED = ["qsgd:bits=4,bucket_size=16,seed=3", "qsgd:bits=4,bucket_size=32,seed=5",
            "onebit:scale=mean_abs", "onebit:bucket_size=32",
            "sortquant:bits=4,split_bits=2,bucket_size=16,seed=3", "kmeans:bits=3,iters=4", "fp16"]


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
    from hvd_quant import dispatch
    _ADAPTER[0] = _make_adapter()
    dispatch.register_frontend("tests", "tests.test_codec_cuda_sim")

    def nan_eq(a, b):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        return bool(np.array_equal(np.isnan(a), np.isnan(b)) and np.array_equal(
            np.where(np.isnan(a), 0, a).view(np.uint32), np.where(np.isnan(b), 0, b).view(np.uint32)))

    import numba_kernels.cuda as K
    res = {}
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
        # a payload of another configuration with the same size: the device check refuses it
        other_spec, n_other = OTHER[spec]
        other = hq.from_spec(other_spec)
        if other != devc and other.wire_nbytes(n_other) == devc.wire_nbytes(100):
            po = other.encode(SimTensor(cuda.to_device(rng.standard_normal(n_other).astype(np.float32))),
                              name="w")
            out = SimTensor(cuda.to_device(np.zeros(100, np.float32)))
            devc.decode_into(po, out, name="w")
            nan_all = bool(np.isnan(out.dev.copy_to_host()).all())
            try:
                devc.check_device_errors()
                raised = False
            except hq.PayloadError as e:
                raised = "differs" in str(e)
            r["bad-config-nan-and-status"] = nan_all and raised
        else:
            r["bad-config-nan-and-status"] = f"{other_spec} is no other configuration of the same size"
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
        # the errors above were read (and reset): a good payload decodes cleanly again
        out = SimTensor(cuda.to_device(np.zeros(100, np.float32)))
        devc.decode_into(pd, out, name="w")
        try:
            devc.check_device_errors()
            r["clean-status"] = nan_eq(yh.reshape(-1), out.dev.copy_to_host())
        except hq.PayloadError as e:
            r["clean-status"] = str(e)
        if spec in THREADED:
            r["threads"] = _threads(hq, cuda, spec, nan_eq)
        res[spec] = r
    res["status-sink"] = _status_sink(cuda)
    res["compiled"] = [list(k) for k in K.kernels]
    json.dump(res, sys.stdout)


def _status_sink(cuda):
    """A prepared decode given ``expect`` but no ``status`` keeps its error bits to itself: a later
    decode given neither still decodes a good payload (it once read them from a shared zero word)."""
    from numba_kernels import prepare, wire
    n, bs, method = 64, 32, wire.METHODS["qsgd"]
    enc = prepare("qsgd", "encode", True, n, bits=4, bucket_size=bs, stochastic=False, norm_l2=False)
    payload = cuda.to_device(np.zeros(enc.total, np.uint8))
    enc(cuda.to_device(np.linspace(-1, 1, n).astype(np.float32)), payload,
        wire.Header(method, 4, 0, 0, bs, 0, (n,)).words(), 0)
    out = cuda.to_device(np.zeros(n, np.float32))
    for expect in (wire.Expect(method, 8, 0, 0, bs, n), None):      # (8 bits: the wrong configuration)
        prepare("qsgd", "decode", True, n, bits=4, bucket_size=bs, accumulate=False)(payload, out, 0, None, expect)
        if np.isnan(out.copy_to_host()).all() != (expect is not None):
            return f"expect={expect}: NaN where not expected, or none where expected"
    return True


def _threads(hq, cuda, spec, nan_eq):
    """Two threads, each with its own equal codec, encode and decode other inputs at once on the
    device: the payloads and decoded values of each are those of its calls alone. The simulator runs
    one kernel at a time (a lock around its launches here), so the threads interleave between
    launches: what they would share (scratch, parameters, status words) is shared across those."""
    import threading
    from numba.cuda.simulator import kernel as sim_kernel
    configure, lock = sim_kernel.FakeCUDAKernel.__getitem__, threading.Lock()

    def serialised(self, config):       # (the simulator keeps a launch's grid on the kernel object)
        def launch(*args):
            with lock:
                return configure(self, config)(*args)
        return launch
    sim_kernel.FakeCUDAKernel.__getitem__ = serialised
    xs = [[np.random.default_rng(10 * t + k).standard_normal(n).astype(np.float32)
           for k, n in enumerate((100, 37, 256))] for t in range(2)]

    def run(codec, inputs):
        out = []
        for x in inputs:
            p = codec.encode(SimTensor(cuda.to_device(x)), name="w")
            y = SimTensor(cuda.to_device(np.ones(x.size, np.float32)))
            codec.decode_into(p, y, accumulate=True, name="w")
            out.append((p.dev.copy_to_host(), y.dev.copy_to_host()))
        return out
    alone = [run(hq.from_spec(spec), inputs) for inputs in xs]
    got = [None, None]
    start = threading.Barrier(2)

    def work(t):
        start.wait()
        got[t] = run(hq.from_spec(spec), xs[t])
    threads = [threading.Thread(target=work, args=(t,)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sim_kernel.FakeCUDAKernel.__getitem__ = configure
    for t in range(2):
        if got[t] is None:
            return f"thread {t} raised"
        for k, ((pa, ya), (pb, yb)) in enumerate(zip(got[t], alone[t])):
            if not (np.array_equal(pa, pb) and nan_eq(ya, yb)):
                return f"thread {t}, call {k} differs from the same calls alone"
    return True


@pytest.fixture(scope="module")
def results():
    import children     # (not at the top: the child imports this module without tests/ on its path)
    return children.json_result("test_codec_cuda_sim", "results")


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("spec", CODECS)
def test_device_codec_path(results, spec, check):
    assert results[spec][check] is True


@pytest.mark.parametrize("spec", THREADED)
def test_device_codec_path_threads(results, spec):
    assert results[spec]["threads"] is True


def test_status_sink(results):
    assert results["status-sink"] is True


def test_codec_kernels_ran(results):
    """The codecs' device path launched the kernels these cases select: the general encode without a
    residual (QSGD 4-bit without error feedback) and the warp decode of 16-element buckets."""
    got = {tuple(k) for k in results["compiled"]}
    assert {("block_encode", 4, 0, 1, False), ("warp_decode", 4, 0, 1)} <= got, sorted(got)
