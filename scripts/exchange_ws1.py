"""World size 1, CUDA: one step of 25 buckets of 1M floats (ResNet-50's 25.6M parameters) through
the exchange with identity collectives: host time per step and per bucket, and wall time per step
with the GPU work waited for.
Runs without Horovod (the GPU machines have none unless it is built): `python3 scripts/exchange_ws1.py`
from the repository root."""
import time

import torch

import hvd_quant
from hvd_quant.exchange import Collectives, Exchange, Memory
from hvd_quant.torch import _backend as tb      # the torch ArrayOps; no Horovod needed

OPS = tb.OPS
coll = Collectives(rank=0, size=1, allgather_async=lambda t, name, sizes=None: t,
                   alltoall_async=lambda t, splits, name: t, allreduce_async=None, synchronize=lambda h: h)
B, N = 25, 1 << 20
xs = [torch.randn(N, device="cuda") for _ in range(B)]
for spec, red, ef in [("qsgd:bits=4,bucket_size=512", "sra", False), ("qsgd:bits=4,bucket_size=512", "allgather", False),
                      ("onebit:bucket_size=512", "sra", True), ("onebit:bucket_size=512", "allgather", True)]:
    ex = Exchange(hvd_quant.from_spec(spec), coll, OPS, reduction=red, memory=Memory(OPS) if ef else None)
    def step(s):
        return ex.finish_all([ex.start(f"b{i}", xs[i].clone(), step=s) for i in range(B)])
    for s in range(5): step(s)
    torch.cuda.synchronize()
    K = 20; t0 = time.perf_counter()
    for s in range(K): out = step(10 + s)
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    host = (t1 - t0) / K * 1e3
    print(f"{spec} {red} ef={ef}: host {host:.2f} ms/step ({host / B * 1e3:.0f} us/bucket), wall {(t2 - t0) / K * 1e3:.2f} ms/step;"
          f" max|sum-x| {max(float((o - x).abs().max()) for o, x in zip(out, xs)):.3g}", flush=True)
    ex.codec.check_device_errors()
t0 = time.perf_counter()
for s in range(20):
    for i in range(B): xs[i].clone()
torch.cuda.synchronize(); print(f"clone of the same 25 x 1M floats: {(time.perf_counter() - t0) / 20 * 1e3:.2f} ms/step")
