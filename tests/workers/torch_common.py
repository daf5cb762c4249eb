"""Helpers shared by the torch workers: a check collector and cross-rank comparisons.

Every worker prints one ``CHECK ok|FAIL <name>: <detail>`` line per check and ends with
``RESULT rank <r>/<n>: <checks> checks, <failures> failures``; it exits 1 when anything failed, so the
pytest side sees both the exit status and which check failed on which rank.
"""
import os
import sys
import time
import traceback

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# Where the workers put tensors: "cpu" (default) or "cuda" (tests/test_torch_gpu.py sets it).
DEVICE = torch.device(os.environ.get("HVDQ_TEST_DEVICE", "cpu"))


def init(**kwargs):
    """hvd.init() and, on CUDA, one GPU per local rank."""
    hvd.init(**kwargs)
    if DEVICE.type == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    return hvd.rank(), hvd.size()


class Checks:
    def __init__(self):
        self.n = 0
        self.failed = []

    def __call__(self, ok, name, detail=""):
        self.n += 1
        ok = bool(ok)
        if not ok:
            self.failed.append(name)
        print(f"CHECK {'ok' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def run(self, name, fn, *args, **kwargs):
        """Run one group of checks; an exception fails it (and is printed) instead of ending the run."""
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except Exception:
            self(False, name, "raised:\n" + traceback.format_exc())
        print(f"TIME {name} {time.perf_counter() - t0:.2f}s", flush=True)

    def finish(self):
        print(f"RESULT rank {hvd.rank()}/{hvd.size()}: {self.n} checks, {len(self.failed)} failures"
              + (f" ({', '.join(self.failed[:20])})" if self.failed else ""), flush=True)
        # One line from rank 0 for every rank (mpirun may interleave the ranks' own lines).
        counts = hvd.allgather_object((self.n, len(self.failed)), name="checks.summary")
        if hvd.rank() == 0:
            print("SUMMARY " + " ".join(f"rank{r}={n}/{f}" for r, (n, f) in enumerate(counts))
                  + f" checks/failures over {hvd.size()} ranks", flush=True)
        hvd.shutdown()
        sys.exit(1 if self.failed else 0)


_counter = [0]


def _uid(prefix):
    _counter[0] += 1
    return f"{prefix}.{_counter[0]}"


def same_on_all_ranks(t):
    """True when ``t`` has the same bytes on every rank (NaN payloads included)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    gathered = hvd.allgather(raw[None], name=_uid("chk.same"))
    return all(torch.equal(gathered[0], gathered[i]) for i in range(1, gathered.shape[0]))


def params_identical(model):
    return same_on_all_ranks(torch.cat([p.detach().reshape(-1).contiguous().view(torch.uint8)
                                        for p in model.parameters()]))


def gather_max(x):
    """Every rank's max |x| (float64 list, rank order)."""
    m = torch.tensor([float(x.detach().abs().max()) if x.numel() else 0.0], dtype=torch.float64)
    return hvd.allgather(m, name=_uid("chk.max")).tolist()


def all_ranks_true(flag):
    v = torch.tensor([1 if flag else 0], dtype=torch.int32)
    return int(hvd.allreduce(v, op=hvd.Min, name=_uid("chk.all"))) == 1
