"""Three 4-bit QSGD encode + decode calls on 100M float32 (bucket 512) on the GPU through the prepared
kernel launches: a small program for Nsight Compute, e.g. (docs/BENCHMARKS.md)

    ncu --clock-control none -k regex:warp_ -s 2 -c 2 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section LaunchStats python3 scripts/profile_codec.py

(``scripts/bench_launchers.py`` times the launchers.)
"""
import numpy as np
from numba import cuda

import numba_kernels
from numba_kernels import wire

n, bits, bs = 100_000_000, 4, 512
x = cuda.to_device(np.random.default_rng(0).standard_normal(n).astype(np.float32))
p = cuda.device_array(wire.layout(2, n, bits, bs).total, np.uint8)
o = cuda.device_array(n, np.float32)
h = wire.Header(2, bits, 0, 0, bs, 0, (n,)).words()
enc = numba_kernels.prepare("qsgd", "encode", True, n, bits=bits, bucket_size=bs, stochastic=True, norm_l2=False)
dec = numba_kernels.prepare("qsgd", "decode", True, n, bits=bits, bucket_size=bs, accumulate=False)
for _ in range(3):
    enc(x, p, h, 1, 0)
    dec(p, o, 0, None, None)
cuda.synchronize()
