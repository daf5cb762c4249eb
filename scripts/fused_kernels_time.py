#!/usr/bin/env python3
"""Device time of the exchange's CUDA launches on one bucket, both kernel paths side by side.

For one 4-bit QSGD bucket (stochastic, bucket 512; ``--numel``, default 11.5M, VGG-16's larger
buckets): the plain encode and decode, SRA's ``reduce_requantize`` (n = 1 and 2 received payloads,
with the residual) and ``decode_chunks`` (2 chunks), allgather's ``decode_sum`` (n = 2), each on the
kernel path its configuration selects ("warp") and forced onto the general path ("block"), beside a
device-to-device copy of the float32 bucket (the memory-bound floor). CUDA events around ``--reps``
queued launches, median of 5 rounds, after a warm-up::

    python3 scripts/fused_kernels_time.py [--numel N] [--reps R]
"""
import argparse

import numpy as np
from numba import cuda

import numba_kernels
import numba_kernels.cuda as K
from numba_kernels import _cuda_warp, wire


def _d2d(dst, src):
    """An asynchronous device-to-device copy on the default stream (``copy_to_device`` waits)."""
    if K.SIMULATOR:
        dst.copy_to_device(src)
    else:
        from numba.cuda.cudadrv import driver
        driver.device_to_device(dst, src, src.nbytes, stream=cuda.default_stream())


def qsgd(kind, numel, bits, bs, **extra):
    """A prepared QSGD op on the device (stochastic, max norm)."""
    if kind in ("encode", "reduce_requantize"):
        extra.update(stochastic=True, norm_l2=False)
    return numba_kernels.prepare("qsgd", kind, True, numel, bits=bits, bucket_size=bs, **extra)


def timed(fn, reps):
    """Device microseconds per launch: ``reps`` launches queued between two events (the host queues
    them faster than the device runs them, so host time stays out), median of 5 such rounds."""
    fn()
    cuda.synchronize()
    ts = []
    for _ in range(5):
        a, b = cuda.event(), cuda.event()
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return float(np.median(ts)) or float("nan")     # (the simulator: 0)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=int, default=11_534_336)
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    n, bits, bs = args.numel, 4, 512
    rng = np.random.default_rng(0)
    x = cuda.to_device(rng.standard_normal(n).astype(np.float32))
    res = cuda.to_device(np.zeros(n, np.float32))
    out = cuda.device_array(n, np.float32)
    lay = wire.layout(wire.METHODS["qsgd"], n, bits, bs)
    h = wire.Header(wire.METHODS["qsgd"], bits, 0, 0, bs, 0, (n,)).words()
    pays = cuda.device_array(2 * lay.total, np.uint8)
    qsgd("encode", n, bits, bs)(x, pays[:lay.total], h, 1)
    qsgd("encode", n, bits, bs)(x, pays[lay.total:], h, 2)
    half = n // 2 // bs * bs
    ch = wire.layout(wire.METHODS["qsgd"], half, bits, bs)
    last = wire.layout(wire.METHODS["qsgd"], n - half, bits, bs)
    gathered = cuda.device_array(ch.total + last.total, np.uint8)
    h0 = wire.Header(wire.METHODS["qsgd"], bits, 0, 0, bs, 0, (half,)).words()
    h1 = wire.Header(wire.METHODS["qsgd"], bits, 0, 0, bs, 0, (n - half,)).words()
    qsgd("encode", half, bits, bs)(x[:half], gathered[:ch.total], h0, 3)
    qsgd("encode", n - half, bits, bs)(x[half:], gathered[ch.total:], h1, 4)
    outp = cuda.device_array(lay.total, np.uint8)
    first = pays[:lay.total]
    copy = timed(lambda: _d2d(out, x), args.reps)
    print(f"numel {n}, QSGD 4-bit stochastic, bucket {bs}; device-to-device copy of the floats: "
          f"{copy:.1f} us")
    print(f"{'operation':<34}{'warp us':>10}{'block us':>10}{'warp/copy':>11}{'block/warp':>12}")
    supported = _cuda_warp.supported
    rows = {}
    for path in ("warp", "block"):
        _cuda_warp.supported = supported if path == "warp" else (lambda *a: False)
        enc = qsgd("encode", n, bits, bs)
        dec = qsgd("decode", n, bits, bs, accumulate=False)
        rr = qsgd("reduce_requantize", n, bits, bs)
        dsum = qsgd("decode_sum", n, bits, bs)
        dch = qsgd("decode_chunks", n, bits, bs, chunk=half)
        ops = [("encode (with residual)", lambda: enc(x, outp, h, 5, 0, res)),
               ("decode", lambda: dec(first, out, 0, None, None)),
               ("reduce_requantize n=1 (residual)", lambda: rr(first, 1, res, outp, h, 5, 0)),
               ("reduce_requantize n=2 (residual)", lambda: rr(pays, 2, res, outp, h, 5, 0)),
               ("decode_chunks (2 chunks)", lambda: dch(gathered, out, 0)),
               ("decode_sum n=2", lambda: dsum(pays, 2, out, 0))]
        for name, fn in ops:
            rows.setdefault(name, {})[path] = timed(fn, args.reps)
    _cuda_warp.supported = supported
    for name, t in rows.items():
        print(f"{name:<34}{t['warp']:>10.1f}{t['block']:>10.1f}{t['warp'] / copy:>11.2f}"
              f"{t['block'] / t['warp']:>12.2f}")


if __name__ == "__main__":
    main()
