"""Memory rates of the GPU for 100M float32 (400 MB): a pure write (``fill_``), a pure read (``sum``)
and a copy, timed as ``hvd_quant.bench codec`` times (CUDA events, median of 10 after a ~20 ms GPU
sleep): the floors of a decode (mostly writes) and an encode (mostly reads). docs/BENCHMARKS.md.

    python3 scripts/memory_rates.py
"""
import torch

x = torch.empty(100_000_000, device="cuda")
y = torch.empty_like(x)


def t(f):
    for _ in range(3):
        f()
    ts = []
    for _ in range(10):
        torch.cuda._sleep(20_000_000)
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record()
        f()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return sorted(ts)[5]


print("100M float32: write (fill_) %.3f ms; read (sum) %.3f ms; copy %.3f ms"
      % (t(lambda: x.fill_(1.0)), t(lambda: x.sum()), t(lambda: y.copy_(x))))
