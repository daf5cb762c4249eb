"""Three 4-bit QSGD encode + decode_into calls on 100M float32 (bucket 512) on the GPU: a small
program for Nsight Compute, e.g. (docs/BENCHMARKS.md)

    ncu --clock-control none -k regex:k3_ -s 2 -c 2 --section SpeedOfLight --section Occupancy \
        --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
        --section MemoryWorkloadAnalysis --section LaunchStats python3 scripts/profile_codec.py
"""
import torch

import hvd_quant as hq

x = torch.randn(100_000_000, device="cuda")
o = torch.empty_like(x)
c = hq.QSGD(bits=4, bucket_size=512)
for _ in range(3):
    p = c.encode(x)
    c.decode_into(p, o)
torch.cuda.synchronize()
