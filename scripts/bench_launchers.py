"""Launcher micro-benchmark on a GPU: host time of a prepared encode + decode of 4096 floats, and device time of encode + decode on 100M floats (CUDA events) for 4-bit (warp path),
3-bit, 5-bit and a 16384-element bucket (general path).

    python3 scripts/bench_launchers.py [--numel N]
"""
import argparse
import time

import numpy as np
from numba import cuda

from numba_kernels import wire

ap = argparse.ArgumentParser()
ap.add_argument("--numel", type=int, default=100_000_000)
args = ap.parse_args()
import numba_kernels  # noqa: E402
import numba_kernels.cuda as K  # noqa: E402


def ops(n, bits, bs):
    """The prepared QSGD encode and decode of ``n`` floats on the device."""
    return (numba_kernels.prepare("qsgd", "encode", True, n, bits=bits, bucket_size=bs, stochastic=True,
                                  norm_l2=False),
            numba_kernels.prepare("qsgd", "decode", True, n, bits=bits, bucket_size=bs, accumulate=False))


def host_us(n=4096, bits=4, bs=512, reps=2000):
    x = cuda.to_device(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    lay = wire.layout(2, n, bits, bs)
    p = cuda.device_array(lay.total, np.uint8)
    o = cuda.device_array(n, np.float32)
    h = wire.Header(2, bits, 0, 0, bs, 0, (n,)).words()
    st = cuda.to_device(np.zeros(2, np.int32))
    out = {}
    e, d = ops(n, bits, bs)
    exp = wire.Expect(2, bits, 0, 0, bs, n)
    xp, pp, op, sp = (a.__cuda_array_interface__["data"][0] for a in (x, p, o, st))
    for _ in range(20):
        e(xp, pp, h, 1, 0)
        d(pp, op, 0, sp, exp)
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        e(xp, pp, h, 1, 0)
        d(pp, op, 0, sp, exp)
    out["prepared, int pointers"] = (time.perf_counter() - t) / reps * 1e6
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        e(x, p, h, 1, 0)
        d(p, o, 0, st, exp)
    out["prepared, device arrays"] = (time.perf_counter() - t) / reps * 1e6
    cuda.synchronize()
    return out


def device_ms(n, bits, bs, reps=10):
    x = cuda.to_device(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    lay = wire.layout(2, n, bits, bs)
    p = cuda.device_array(lay.total, np.uint8)
    o = cuda.device_array(n, np.float32)
    h = wire.Header(2, bits, 0, 0, bs, 0, (n,)).words()
    enc, dec = ops(n, bits, bs)
    enc(x, p, h, 1)
    dec(p, o)
    cuda.synchronize()
    e0, e1, e2 = cuda.event(), cuda.event(), cuda.event()
    best = [1e9, 1e9]
    for _ in range(reps):
        e0.record()
        enc(x, p, h, 1)
        e1.record()
        dec(p, o)
        e2.record()
        e2.synchronize()
        best[0] = min(best[0], cuda.event_elapsed_time(e0, e1))
        best[1] = min(best[1], cuda.event_elapsed_time(e1, e2))
    return best


print("device:", cuda.get_current_device().name)
for k, v in host_us().items():
    print(f"host us per encode+decode of 4096 floats ({k}): {v:.2f}")
for bits, bs in ((4, 512), (3, 512), (5, 512), (4, 16384)):
    enc, dec = device_ms(args.numel, bits, bs)
    path = K.kernel_path(bits, bs, args.numel)
    print(f"{args.numel} floats bits={bits} bs={bs} [{path}]: encode {enc:.3f} ms decode {dec:.3f} ms "
          f"total {enc + dec:.3f} ms")
