"""Encode/decode times of single codec configurations on a GPU (100M float32, CUDA events, median of
20 after a ~20 ms GPU sleep, as hvd_quant.bench codec does), then a cProfile of 300 small (4096-element)
4-bit encode + decode_into calls: where the per-call host time goes.

    python3 scripts/codec_configs.py
"""
import cProfile, pstats, io, sys
import torch
import hvd_quant as hq

def t(fn, rep=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rep):
        torch.cuda._sleep(20_000_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    ts.sort()
    return ts[len(ts) // 2]

n = 100_000_000
x = torch.randn(n, device="cuda")
out = torch.empty_like(x)
for spec in ["qsgd:bits=4,bucket_size=512", "qsgd:bits=4,bucket_size=512,mode=deterministic",
             "qsgd:bits=4,bucket_size=512,norm=l2", "qsgd:bits=8,bucket_size=512",
             "qsgd:bits=4,bucket_size=128", "qsgd:bits=4,bucket_size=1024", "onebit:bucket_size=512"]:
    c = hq.from_spec(spec)
    p = c.encode(x)
    e = t(lambda: c.encode(x))
    d = t(lambda: c.decode_into(p, out))
    print(f"{spec:50s} encode {e:.3f} ms  decode {d:.3f} ms  sum {e + d:.3f}", flush=True)
import numba_kernels.cuda as K
print("persistent decode grid (blocks) per kernel:", {k: K._RESIDENT.get(id(d)) for k, d in K.kernels.items()
                                                     if id(d) in K._RESIDENT}, flush=True)
c = hq.from_spec("qsgd:bits=4,bucket_size=512")
s = torch.randn(4096, device="cuda")
o = torch.empty_like(s)
for _ in range(50):
    c.decode_into(c.encode(s), o)
torch.cuda.synchronize()
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    c.decode_into(c.encode(s), o)
torch.cuda.synchronize()
pr.disable()
st = io.StringIO()
pstats.Stats(pr, stream=st).sort_stats("tottime").print_stats(30)
print(st.getvalue()[:9000])
