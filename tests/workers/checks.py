"""The check recorder shared by the multi-process workers (PyTorch and TensorFlow alike).

Every check prints one ``CHECK ok|FAIL name: detail`` line; ``run`` turns an exception in a group of
checks into a failed check instead of ending the run; ``finish`` prints this rank's ``RESULT`` line,
rank 0 a ``SUMMARY`` of every rank, shuts Horovod (or the torch.distributed world,
``hvd_quant.torch.ddp.shutdown``) down and exits 1 if anything failed.
"""
import sys
import time
import traceback


class Checks:
    def __init__(self, hvd):
        self.hvd = hvd
        self.n = 0
        self.failed = []

    def __call__(self, ok, name, detail=""):
        self.n += 1
        ok = bool(ok)
        if not ok:
            self.failed.append(name)
        print(f"CHECK {'ok' if ok else 'FAIL'} {name}: {detail}", flush=True)
        return ok

    def raises(self, what, fn, exc=ValueError, text=""):
        """Check that ``fn()`` raises ``exc`` with ``text`` in its message."""
        try:
            fn()
        except exc as e:
            self(text in str(e), f"errors: {what} raises {exc.__name__}", str(e)[:160])
        else:
            self(False, f"errors: {what} raises {exc.__name__}", "no error")

    def run(self, name, fn, *args, **kwargs):
        """Run one group of checks; an exception fails it (and is printed) instead of ending the run."""
        t0 = time.perf_counter()
        try:
            fn(*args, **kwargs)
        except Exception:
            self(False, name, "raised:\n" + traceback.format_exc())
        print(f"TIME {name} {time.perf_counter() - t0:.2f}s", flush=True)

    def finish(self):
        hvd = self.hvd
        print(f"RESULT rank {hvd.rank()}/{hvd.size()}: {self.n} checks, {len(self.failed)} failures"
              + (f" ({', '.join(self.failed[:20])})" if self.failed else ""), flush=True)
        # One line from rank 0 for every rank (mpirun may interleave the ranks' own lines).
        counts = hvd.allgather_object((self.n, len(self.failed)), name="checks.summary")
        if hvd.rank() == 0:
            print("SUMMARY " + " ".join(f"rank{r}={n}/{f}" for r, (n, f) in enumerate(counts))
                  + f" checks/failures over {hvd.size()} ranks", flush=True)
        sys.stdout.flush()
        code = 1 if self.failed else 0
        if isinstance(hvd, TorchWorld):     # barrier, group destroyed, then the process leaves
            from hvd_quant.torch.ddp import shutdown
            shutdown(exit_code=code)
        hvd.shutdown()
        sys.exit(code)


class TorchWorld:
    """What :class:`Checks` asks of Horovod, over the torch.distributed world (the torchrun workers)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist = dist

    def rank(self):
        return self.dist.get_rank()

    def size(self):
        return self.dist.get_world_size()

    def allgather_object(self, obj, name=None):
        out = [None] * self.size()
        self.dist.all_gather_object(out, obj)
        return out

