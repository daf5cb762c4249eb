"""Elastic Horovod (``hvd.elastic.run`` + ``hvd.elastic.TorchState``) with ``hvd_quant.torch.OneBitAdam``.

Launched by tests/test_onebit_adam.py as tests/workers/torch_elastic.py is (the schedule of
tests/workers/elastic_schedule.py: 2 ranks, 3, then 2 again); ``freeze_step`` falls inside the first
phase, so both changes of the world happen with the variance frozen and the momentum in 1 bit.

Checks (``CHECK ok|FAIL``), on every rank: every step runs at its phase's size; after every step the
parameters and the momentum are bit-identical on all ranks (a joining worker gets rank 0's step,
momentum and frozen variance from ``TorchState.sync``, i.e. ``hvd.broadcast_optimizer_state``);
the variance stays as it was at the freeze across both changes; ``state.restore()`` after a step
gives back the committed parameters, optimizer state and residuals exactly (``commit``/``restore``
round trip); ``state.reset`` (the world change) leaves the optimizer bound to the new world's
collectives.
"""
import os
import sys
import time

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402
from elastic_schedule import PHASE_STEPS, SIZES, TOTAL, next_phase  # noqa: E402

import hvd_quant  # noqa: E402
import hvd_quant.torch  # noqa: E402

FREEZE = max(2, PHASE_STEPS // 2)
KEY = "hvd_quant_onebit_adam"

hvd.init()
check = _checks.Checks(hvd)
torch.manual_seed(1234)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
opt = hvd_quant.torch.OneBitAdam(model.parameters(), lr=1e-2, freeze_step=FREEZE, bucket_bytes=4096,
                                 compression=hvd_quant.OneBit(bucket_size=64),
                                 named_parameters=model.named_parameters())
state = hvd.elastic.TorchState(model=model, optimizer=opt, batch=0, phase=0)
LAST = {"size": None, "variance": None}


def same_on_all_ranks(t, name):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    g = hvd.allgather(raw[None], name=name)
    return all(torch.equal(g[0], g[i]) for i in range(1, g.shape[0]))


def flat(key):
    return torch.cat([opt.state[p][key].reshape(-1) for p in model.parameters()])


def params():
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def snapshot():
    ours = opt.state_dict()[KEY]
    return (params().clone(), flat("exp_avg").clone(), flat("exp_avg_sq").clone(),
            [int(opt.state[p]["step"]) for p in model.parameters()],
            {k: v.clone() for k, v in ours["worker_residuals"].items()},
            {k: v.clone() for k, v in ours["server_residuals"].items()})


def equal_snapshots(a, b):
    same = all(torch.equal(x, y) for x, y in zip(a[:3], b[:3])) and a[3] == b[3]
    for d, e in zip(a[4:], b[4:]):
        same = same and d.keys() == e.keys() and all(torch.equal(d[k], e[k]) for k in d)
    return same


def batch_for(b):
    g = torch.Generator().manual_seed(1000 * b + hvd.rank())
    return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def one_step(b):
    x, y = batch_for(b)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        b, size = state.batch, hvd.size()
        next_phase(state, b, hvd.rank())
        if LAST["size"] != size:
            check(True, f"world.b{b}", f"rank {hvd.rank()} size {LAST['size']} -> {size}")
        check(size == SIZES[state.phase], f"size.b{b}", f"phase {state.phase} runs at {size} ranks")
        if b == FREEZE + 1:     # commit / restore round trip after the freeze
            committed = snapshot()
            one_step(b)
            moved = not torch.equal(params(), committed[0])
            state.restore()
            check(moved and equal_snapshots(snapshot(), committed), f"restore.b{b}",
                  "state.restore() gives back the committed parameters, step, momentum, variance and "
                  "residuals")
        one_step(b)
        check(opt._coll is not None and opt._coll.size == size, f"bound.b{b}",
              f"the optimizer's collectives have {size} ranks")
        check(same_on_all_ranks(params(), f"p.{b}.{size}") and same_on_all_ranks(flat("exp_avg"), f"m.{b}.{size}"),
              f"identical.b{b}", f"parameters and momentum bit-identical on {size} ranks")
        if opt.frozen:
            v = flat("exp_avg_sq").clone()
            if LAST["variance"] is None:
                LAST["variance"] = v
            check(torch.equal(v, LAST["variance"]) and same_on_all_ranks(v, f"v.{b}.{size}"),
                  f"variance.b{b}", "the variance is the frozen one, on every rank")
        if b >= FREEZE:         # step b + 1 exchanged the momentum in 1 bit
            t = opt.bytes_per_step()
            check(t.sent_bytes < t.fp32_bytes / 8, f"bytes.b{b}", f"ratio {t.ratio:.1f}")
        LAST["size"] = size
        state.batch = b + 1
        state.commit()


t0 = time.monotonic()
train(state)
print(f"DONE rank {hvd.rank()}/{hvd.size()} batch {state.batch} in {time.monotonic() - t0:.1f}s", flush=True)
check.finish()
