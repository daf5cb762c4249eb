"""Worker: ranks configured differently get a clear error, on every rank, within seconds.

Rank 0 uses one configuration, the other ranks another. For ``hvd_quant.torch.DistributedOptimizer``
the construction-time handshake raises ``ConfigMismatchError``; for stock
``hvd.DistributedOptimizer(compression=codec)`` the per-tensor handshake that travels with the first
exchange raises it from ``synchronize()``, also where the payload group is on (on CUDA by default: a
collective made at the first result, so compared before it is made). Each case prints
``MISMATCH <case> <slowest rank's seconds> <ranks ok>/<ranks> <rank 0's first line>`` (from rank 0); the
test asserts every rank was ok for every case, with seconds under the limit.
"""
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hqt
from hvd_quant.exchange import ConfigMismatchError

from torch_common import DEVICE, Checks, all_ranks_true, init, payload_group

R, N = init()
check = Checks()
LIMIT_S = 10.0
FIRST = R == 0

CASES = {   # case: (kwargs on rank 0, kwargs on the others, what the message must name)
    "bits": (dict(compression="qsgd:bits=4"), dict(compression="qsgd:bits=8"), "bits=4"),
    "bucket_size": (dict(compression="qsgd:bits=4,bucket_size=512"),
                    dict(compression="qsgd:bits=4,bucket_size=256"), "bucket_size=512"),
    "method": (dict(compression="qsgd:bits=4"), dict(compression="onebit"), "onebit"),
    "reduction": (dict(compression="qsgd:bits=4", reduction="sra"),
                  dict(compression="qsgd:bits=4", reduction="allgather"), "reduction=allgather"),
    "bucket_bytes": (dict(compression="qsgd:bits=4", bucket_bytes=8192),
                     dict(compression="qsgd:bits=4", bucket_bytes=65536), "bucket_bytes=8192"),
    "min_compress_numel": (dict(compression="qsgd:bits=4", min_compress_numel=1024),
                           dict(compression="qsgd:bits=4", min_compress_numel=4096),
                           "min_compress_numel=4096"),
    "groups": (dict(compression="qsgd:bits=4", groups=2), dict(compression="qsgd:bits=4"),
               "configured differently"),
}


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 64)).to(DEVICE)


def report(case, dt, msg, must):
    ok = msg is not None and "configured differently" in msg and must in msg and dt < LIMIT_S
    check(all_ranks_true(ok), f"mismatch {case}", f"{dt:.2f}s: {msg!r}"[:600])
    # Rank 0 reports every rank's outcome in one line (mpirun may interleave the ranks' lines).
    everyone = hvd.allgather_object((ok, dt), name=f"report.{case}")
    if R == 0:
        first = (msg or "no error").splitlines()[0][:160]
        print(f"MISMATCH {case} {max(t for _, t in everyone):.2f} "
              f"{sum(o for o, _ in everyone)}/{N} {first}", flush=True)


def ours():
    torch.optim.SGD(model().parameters(), lr=0.1)   # torch's first optimizer imports torch._dynamo (s)
    hvd.allreduce(torch.zeros(1), name="align")     # time from when every rank is here
    for case, (a, b, must) in CASES.items():
        kw = a if FIRST else b
        m = model()
        t0 = time.perf_counter()
        try:
            hqt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                     named_parameters=m.named_parameters(), **kw)
            msg = None
        except ConfigMismatchError as e:
            msg = str(e)
        report(f"ours/{case}", time.perf_counter() - t0, msg, must)
    # The same configuration on every rank passes the handshake.
    m = model()
    hqt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                             named_parameters=m.named_parameters(), compression="qsgd:bits=4")
    check(True, "ours/same configuration constructs")


def stock(tag="stock"):
    for case, (a, b, must) in (("bits", ("qsgd:bits=4", "qsgd:bits=8", "bits=4")),
                               ("method", ("qsgd:bits=4", "onebit", "onebit")),
                               ("bucket_size", ("qsgd:bits=4,bucket_size=512",
                                                "qsgd:bits=4,bucket_size=128", "bucket_size=128"))):
        m = model()
        opt = hvd.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                       named_parameters=[(f"{tag}.{case}.{k}", v)
                                                         for k, v in m.named_parameters()],
                                       compression=hvd_quant.from_spec(a if FIRST else b))
        t0 = time.perf_counter()
        try:
            F.mse_loss(m(torch.randn(8, 32, device=DEVICE)), torch.zeros(8, 64, device=DEVICE)).backward()
            opt.synchronize()
            msg = None
        except ConfigMismatchError as e:
            msg = str(e)
        report(f"{tag}/{case}", time.perf_counter() - t0, msg, must)


def stock_payload_group():
    """The stock cases again with the payload group on (on CPU a Gloo group, as torch_optim's
    payload-group cases make it): the group is made at the first result, a collective, so the ranks'
    configurations must be compared before it, not after."""
    with payload_group():
        stock("stock-group")


if __name__ == "__main__":
    check.run("ours", ours)
    check.run("stock", stock)
    check.run("stock, payload group", stock_payload_group)
    check.finish()
