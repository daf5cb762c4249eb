"""Child: the Numba half of the TensorFlow frontend's device exchange, without TensorFlow.

``hvd_quant/tensorflow/_device.py`` gives the core (``hvd_quant.exchange.Exchange``) an ArrayOps table
over Numba device arrays (``DEVICE_OPS``) and the codecs an adapter for them. Here N ranks are
simulated in one process: each rank's ``Exchange`` talks to a recording Collectives table (the one the
graph path uses), and this script moves the recorded bytes between the ranks as Horovod's alltoall
and allgather would. For every codec x reduction x size, with and without error feedback, over three
steps, it checks:

* the device exchange's result equals the host exchange's (``OPS``, NumPy, the tested CPU path) to
  within one quantization unit of the bucket (the CUDA and CPU kernels may round a tie differently)
  -- and is within the codec bound of the exact sum;
* every simulated rank decodes the same bytes (identical results);
* DEVICE_OPS' elementwise operations against NumPy.

Runs under ``NUMBA_ENABLE_CUDASIM=1`` (CPU, small sizes) or on a real GPU (``--sizes`` larger).
Prints ``DEVICE ok|FAIL <case>: <detail>`` and ``DEVICE-RESULT <checks> <failures>``.
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import hvd_quant  # noqa: E402
from hvd_quant.exchange import Collectives, Exchange  # noqa: E402
from hvd_quant.memory import Memory  # noqa: E402
from hvd_quant.tensorflow import _device as D  # noqa: E402   (no TensorFlow import)

RESULTS = [0, 0]


def report(ok, case, detail=""):
    RESULTS[0] += 1
    RESULTS[1] += not ok
    print(f"DEVICE {'ok' if ok else 'FAIL'} {case}: {detail}", flush=True)


class _Deferred:
    def __init__(self, t, splits=None):
        self.tensor, self.splits, self.result = t, splits, None


def coll(rank, size):
    return Collectives(rank=rank, size=size, allgather_async=lambda t, name: _Deferred(t),
                       alltoall_async=lambda t, sp, name: _Deferred(t, list(sp)),
                       allreduce_async=None, synchronize=lambda h: h.result)


def host_ops():
    """The host ArrayOps of hvd_quant/tensorflow/_backend.py, rebuilt here without TensorFlow."""
    from hvd_quant.exchange import ArrayOps

    def add_(a, b):
        return np.add(a, b, out=a) if a.flags.writeable else a + b
    return ArrayOps(
        flatten=lambda ts: np.concatenate([np.asarray(t, np.float32).reshape(-1) for t in ts]),
        zeros=lambda n, like: np.zeros(n, np.float32), empty=lambda n, like: np.empty(n, np.float32),
        slice=lambda b, x, y: b[x:y],
        empty_bytes=lambda n, like: np.empty(n, np.uint8),
        add_=add_, scale_=lambda a, s: np.multiply(a, np.float32(s), out=a),
        numel=lambda t: int(np.size(t)),
        from_bytes=lambda b: np.frombuffer(bytes(b), np.uint8).copy(),
        to_bytes=lambda t: np.asarray(t).tobytes(), to_like=lambda t, like: np.array(t, np.float32),
        clone=lambda t: np.array(t, copy=True))


def to_host(a):
    return a.copy_to_host() if D.is_device_array(a) else np.asarray(a)


def exchange_all(exs, flats, step):
    """One exchange on every simulated rank; returns each rank's float32 sum (host arrays)."""
    n = len(exs)
    ps = [ex.start("bucket", f, step=step, header="bucket") for ex, f in zip(exs, flats)]
    if exs[0].reduction == "sra":
        for r in range(n):
            parts = []
            for j in range(n):
                sp = ps[j].handle.splits
                off = sum(sp[:r])
                parts.append(to_host(ps[j].handle.tensor)[off:off + sp[r]])
            recv = np.concatenate(parts)
            ps[r].handle.result = exs[r].ops.from_bytes(recv.tobytes()) if D.is_device_array(
                ps[r].handle.tensor) or exs[r].ops is D.DEVICE_OPS else recv
        for r in range(n):
            exs[r].advance(ps[r])
    gathered = np.concatenate([to_host(p.handle.tensor) for p in ps])
    outs = []
    for r in range(n):
        ps[r].handle.result = (exs[r].ops.from_bytes(gathered.tobytes()) if exs[r].ops is D.DEVICE_OPS
                               else gathered)
        outs.append(to_host(exs[r].finish(ps[r])).astype(np.float32))
    return outs


def unit(spec, xs):
    """One quantization unit per element: bucket max (summed over ranks) / levels."""
    c = hvd_quant.from_spec(spec)
    n = xs[0].size
    if spec.startswith("qsgd"):
        d, s = c.bucket_size, c.levels
    elif spec.startswith("onebit"):
        d, s = c.bucket_size or n, 1
    else:
        return sum(np.abs(x) for x in xs) * 2.0 ** -10 + 1e-30
    nb = -(-n // d)
    m = np.zeros(nb)
    for x in xs:
        pad = np.zeros(nb * d)
        pad[:n] = np.abs(x)
        m += pad.reshape(nb, d).max(1)
    return np.repeat(m / s, d)[:n] + 1e-30


def run_case(spec, reduction, n_ranks, numel, ef):
    case = f"{spec} {reduction} N={n_ranks} n={numel} ef={ef}"
    H, DV = host_ops(), D.DEVICE_OPS
    mk = lambda ops, r: Exchange(hvd_quant.from_spec(spec), coll(r, n_ranks), ops, reduction=reduction,  # noqa: E731
                                 memory=Memory(ops) if ef else None)
    hosts = [mk(H, r) for r in range(n_ranks)]
    devs = [mk(DV, r) for r in range(n_ranks)]
    worst = 0.0
    ok = True
    for step in range(3):
        rs = np.random.RandomState(100 * step + numel)
        xs = [(rs.randn(numel) * (1 + j)).astype(np.float32) for j in range(n_ranks)]
        h = exchange_all(hosts, [x.copy() for x in xs], step)
        d = exchange_all(devs, [D._cuda().to_device(x) for x in xs], step)
        same = all(np.array_equal(d[0].view(np.uint32), o.view(np.uint32)) for o in d[1:])
        if not same:
            report(False, case, f"step {step}: ranks decoded different values")
            return
        u = unit(spec, xs) * (2 if reduction == "sra" else 1) * (3 if ef else 1)
        diff = np.abs(d[0].astype(np.float64) - h[0])
        r = float((diff / u).max()) if numel else 0.0
        worst = max(worst, r)
        ok &= r <= 1.0 and bool(np.isfinite(d[0]).all())
    report(ok, case, f"max |device - host| / quantization unit = {worst:.3g}")


def run_ops():
    cuda = D._cuda()
    rs = np.random.RandomState(0)
    a, b = rs.randn(1000).astype(np.float32), rs.randn(1000).astype(np.float32)
    da, db = cuda.to_device(a), cuda.to_device(b)
    ok = np.allclose(D.DEVICE_OPS.add_(da, db).copy_to_host(), a + b)
    ok &= np.allclose(D.DEVICE_OPS.scale_(da, 0.5).copy_to_host(), (a + b) * 0.5)
    ok &= np.allclose(D.DEVICE_OPS.scale_(da, cuda.to_device(np.array([2.0], np.float32))).copy_to_host(), a + b)
    ok &= float(np.abs(D.DEVICE_OPS.zeros(513, None).copy_to_host()).max()) == 0.0
    eb = D.DEVICE_OPS.empty_bytes(12, None)
    ok &= eb.size == 12 and eb.dtype == np.uint8
    ok &= D.DEVICE_OPS.to_bytes(D.DEVICE_OPS.from_bytes(b"hvdq")) == b"hvdq"
    c = D.DEVICE_OPS.clone(da)
    D.DEVICE_OPS.scale_(c, 0.0)
    ok &= not np.allclose(da.copy_to_host(), 0) and np.allclose(c.copy_to_host(), 0)
    view = D.DEVICE_OPS.slice(c, 10, 20)
    D.DEVICE_OPS.add_(view, cuda.to_device(np.ones(10, np.float32)))
    host = c.copy_to_host()
    ok &= np.allclose(host[10:20], 1) and np.allclose(host[:10], 0) and np.allclose(host[20:], 0)
    report(ok, "DEVICE_OPS against NumPy (views, add, scale, a - out, zeros, cat, clone, bytes)")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1,200,701")
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--specs", default="qsgd:bits=8,bucket_size=64,mode=deterministic;"
                                      "qsgd:bits=4,bucket_size=64,seed=5;onebit:bucket_size=64;fp16")
    a = p.parse_args()
    D.register()
    print(f"DEVICE-INFO simulator={os.environ.get('NUMBA_ENABLE_CUDASIM', '0')} "
          f"device={D._cuda().get_current_device().name if hasattr(D._cuda(), 'get_current_device') else '?'}",
          flush=True)
    run_ops()
    specs = a.specs.split(";")
    for n_ranks in map(int, a.ranks.split(",")):
        for numel in map(int, a.sizes.split(",")):
            for spec in specs:
                for reduction in ("sra", "allgather"):
                    run_case(spec, reduction, n_ranks, numel, ef=spec.startswith("onebit"))
    print(f"DEVICE-RESULT {RESULTS[0]} {RESULTS[1]}", flush=True)
    sys.exit(1 if RESULTS[1] else 0)


if __name__ == "__main__":
    main()
