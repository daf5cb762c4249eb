"""Helpers shared by the torch workers: a check collector and cross-rank comparisons.

Every worker prints one ``CHECK ok|FAIL <name>: <detail>`` line per check and ends with
``RESULT rank <r>/<n>: <checks> checks, <failures> failures``; it exits 1 when anything failed, so the
pytest side sees both the exit status and which check failed on which rank.
"""
import contextlib
import os
import sys

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402

# Where the workers put tensors: "cpu" (default) or "cuda" (tests/test_torch_gpu.py sets it).
DEVICE = torch.device(os.environ.get("HVDQ_TEST_DEVICE", "cpu"))
# The payload group's backend on DEVICE: NCCL on CUDA (the default there), Gloo on CPU (forced).
GROUP_BACKEND = "nccl" if DEVICE.type == "cuda" else "gloo"


def init(**kwargs):
    """hvd.init() and, on CUDA, one GPU per local rank."""
    hvd.init(**kwargs)
    group = os.environ.get("HVDQ_TEST_PAYLOAD_GROUP")
    if group:   # the payload group on this device type too (on CPU: "gloo"), as on CUDA
        _payload_groups()[DEVICE.type] = group
    if DEVICE.type == "cuda":
        torch.cuda.set_device(hvd.local_rank())
    return hvd.rank(), hvd.size()


def _payload_groups():
    from hvd_quant.torch import _backend
    return _backend.PAYLOAD_GROUP


@contextlib.contextmanager
def payload_group(on=True):
    """Within: the optimizers made make their payload group on DEVICE (``on``) or none; the table is
    restored after."""
    table = _payload_groups()
    saved = dict(table)
    table.clear()
    if on:
        table[DEVICE.type] = GROUP_BACKEND
    try:
        yield
    finally:
        table.clear()
        table.update(saved)


class Checks(_checks.Checks):
    def __init__(self):
        super().__init__(hvd)


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
