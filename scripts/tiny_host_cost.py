"""Host cost of one CUDA encode + decode_into of 4096 floats (µs per call, 1000 calls then one
synchronisation), with a cProfile of 300 calls: `python3 scripts/tiny_host_cost.py`."""
import cProfile
import pstats
import time

import torch

import hvd_quant

for spec in ("qsgd:bits=4,bucket_size=512", "onebit:bucket_size=512"):
    c = hvd_quant.from_spec(spec)
    x = torch.randn(4096, device="cuda"); out = torch.empty(4096, device="cuda")
    for _ in range(50): c.decode_into(c.encode(x), out)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(1000): c.decode_into(c.encode(x), out)
    torch.cuda.synchronize()
    print(spec, "tiny encode+decode_into us/call:", (time.perf_counter() - t) * 1e3)
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): c.decode_into(c.encode(x), out)
    pr.disable(); torch.cuda.synchronize()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
