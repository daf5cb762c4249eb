"""Elastic training (``hvd.elastic.run`` + ``hvd.elastic.TorchState``) through hvd_quant.

Launched by tests/test_torch_elastic.py with ``horovodrun --gloo -np 2 --min-np 2 --max-np 3
--host-discovery-script <script>``; the script prints the hosts file ``HVDQ_ELASTIC_HOSTS``, which rank
0 rewrites when the schedule says so (as Horovod's own elastic tests do): ``PHASE_STEPS`` steps at
2 ranks, then ``localhost:3`` (Horovod starts a worker and raises ``HostsUpdatedInterrupt``; the state
is synced from rank 0), ``PHASE_STEPS`` steps at 3 ranks, then ``localhost:2`` (Horovod removes the
worker of the last slot), ``PHASE_STEPS`` steps at 2 ranks again. ``state.commit()`` after every step.

``python torch_elastic.py hvdq``: three models, each with ``hvd_quant.torch.DistributedOptimizer``:
QSGD 4-bit SRA, 1-bit SRA (error feedback) and QSGD 4-bit ``reduction="auto"``.
``python torch_elastic.py stock``: two models with Horovod's optimizer: ``compression=QSGD(bits=4)``
(the default, ``reduction="auto"``) and ``StockCompression(QSGD(bits=4), reduction="sra")``.
``python torch_elastic.py hvdq,stock``: all five models in one job.

Checks (``CHECK ok|FAIL``), on every rank: each step runs at the world size of its phase; after every
step every model's parameters are bit-identical on all ranks; SRA's plans follow the world size (one
chunk per rank; the session's / optimizer's collectives have ``hvd.size()`` ranks; the fp32 traffic
model scales as ``2 (N-1) / N``); error-feedback residuals across a change (module doc of the test);
``reduction="auto"`` measures again after each change.
"""
import os
import sys
import time

import torch

import horovod.torch as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402
from elastic_schedule import SIZES, TOTAL, next_phase  # noqa: E402

import hvd_quant  # noqa: E402
import hvd_quant.torch  # noqa: E402
from hvd_quant import _stock  # noqa: E402
from hvd_quant.exchange import Memory  # noqa: E402
from hvd_quant.scheduler import AutoChoice  # noqa: E402

MODES = sys.argv[1].split(",")

hvd.init()
if os.environ.get("HVDQ_TEST_PAYLOAD_GROUP"):   # the payload groups on the CPU too, as on CUDA
    from hvd_quant.torch import _backend
    _backend.PAYLOAD_GROUP["cpu"] = os.environ["HVDQ_TEST_PAYLOAD_GROUP"]
check = _checks.Checks(hvd)
torch.manual_seed(1234)


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                               torch.nn.ReLU(), torch.nn.Linear(64, 10))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


MODELS, OPTS, STOCK = {}, {}, {}
if not MODES or set(MODES) - {"hvdq", "stock"}:
    raise SystemExit(f"modes must be hvdq, stock or both (comma-separated), got {sys.argv[1]!r}")
if "hvdq" in MODES:
    for key, comp, red in (("qsgd_sra", hvd_quant.QSGD(bits=4), "sra"),
                           ("onebit_sra", hvd_quant.OneBit(), "sra"),
                           ("qsgd_auto", hvd_quant.QSGD(bits=4), "auto")):
        m = MODELS[key] = make_model()
        OPTS[key] = hvd_quant.torch.DistributedOptimizer(
            sgd(m), named_parameters=m.named_parameters(), compression=comp, reduction=red)
if "stock" in MODES:
    codec = hvd_quant.QSGD(bits=4)
    sra = hvd_quant.StockCompression(hvd_quant.QSGD(bits=4), reduction="sra")
    for key, comp in (("stock_auto", codec), ("stock_sra", sra)):
        m = MODELS[key] = make_model()
        OPTS[key] = hvd.DistributedOptimizer(sgd(m), named_parameters=m.named_parameters(),
                                             compression=comp)
        STOCK[key] = comp       # a codec's state is the optimizer's: _stock.state_of(opt) once it stepped

kwargs = {f"model_{k}": m for k, m in MODELS.items()}
kwargs.update({f"opt_{k}": o for k, o in OPTS.items()})
state = hvd.elastic.TorchState(batch=0, phase=0, **kwargs)

# What this process saw at the end of its last step (survives Horovod's reset, not a new process).
LAST = {"size": None, "worker": None, "server": {}, "fp32": {}, "seen": set()}


def gather_same(t, name):
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    g = hvd.allgather(raw[None], name=name)
    return all(torch.equal(g[0], g[i]) for i in range(1, g.shape[0]))


def params_blob(model):
    return torch.cat([p.detach().reshape(-1).contiguous().view(torch.uint8) for p in model.parameters()])


def batch_for(b):
    g = torch.Generator().manual_seed(1000 * b + hvd.rank())
    return torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)


def onebit_memory():
    opt = OPTS.get("onebit_sra")
    return None if opt is None else opt._memory


def worker_residuals(mem):
    return {n: r.clone() for n, r in mem.items(Memory.WORKER)}


def server_residuals(mem):
    return {k: r.clone() for k, r in mem.items(Memory.SERVER)}


def before_step(b, size):
    """Checks at the first step after this process joined or the world changed."""
    mem = onebit_memory()
    auto = [o for k, o in OPTS.items() if k == "qsgd_auto"]
    if LAST["size"] is None:
        check(True, f"joined.b{b}", f"rank {hvd.rank()}/{size} starts at batch {b} phase {state.phase}")
        if mem is not None:
            check(not worker_residuals(mem) and not server_residuals(mem), f"residuals.fresh.b{b}",
                  "a worker that joins starts with no error-feedback residuals")
        return
    check(True, f"world.changed.b{b}", f"rank {hvd.rank()} size {LAST['size']} -> {size}")
    if mem is not None:
        now = worker_residuals(mem)
        old = LAST["worker"]
        same = now.keys() == old.keys() and all(torch.equal(now[k], old[k]) for k in now)
        check(same and now, f"residuals.worker_kept.b{b}",
              f"{len(now)} worker residual(s) kept unchanged across the reset")
        server = server_residuals(mem)
        same = server.keys() == LAST["server"].keys() and all(
            torch.equal(server[k], LAST["server"][k]) for k in server)
        check(same, f"residuals.server_kept.b{b}",
              f"server residuals kept as they were, sizes {sorted({k[2] for k in server})}")
        # keyed by (bucket, rank, size): a size this rank had before continues its old residual
        mine = [k for k in server if k[1:] == (hvd.rank(), size)]
        seen = (hvd.rank(), size) in LAST["seen"]
        rule = ("continues the server residual it left at this size" if mine
                else "no server residual yet (starts from zero)")
        check(bool(mine) == seen, f"residuals.server_rule.b{b}", f"rank {hvd.rank()} at size {size}: {rule}")
    for opt in auto:
        # still the old world's choice until the first gradient rebinds the optimizer
        check(opt._sched.auto.choice is not None, f"auto.had_choice.b{b}", repr(opt._sched.auto.choice))


def after_step(b, size, first):
    rank = hvd.rank()
    for k, m in MODELS.items():
        check(gather_same(params_blob(m), f"chk.{b}.{size}.{k}"), f"identical.{k}.b{b}",
              f"params bit-identical on {size} ranks")
    # the exchange follows the world size
    for k, opt in OPTS.items():
        if k in STOCK:
            sc = _stock.state_of(opt)
            sessions = list(sc._sessions.values())
            ok = sessions and all(s.coll.size == size for s in sessions)
            plans = [p for s in sessions for ex in s.exchanges.values() if ex.reduction == "sra"
                     for p in ex._setups.values() if p.coll is s.coll]
            route = sc.reduction_in_use(opt)
        else:
            ok = opt._coll is not None and opt._coll.size == size and opt._coll.rank == rank
            ex = opt._exchanges.get("sra")
            plans = [] if ex is None else [p for p in ex._setups.values() if p.coll is ex.coll]
            route = opt.reduction_in_use()
        ok = ok and all(len(p.send) == size for p in plans)
        if first or not ok:
            check(ok, f"bound.{k}.b{b}", f"collectives of {size} ranks, {len(plans)} SRA plan(s) "
                  f"with {[len(p.send) for p in plans]} chunks, next route {route}")
        if k not in STOCK:
            t = opt.bytes_per_step()
            if first:
                print(f"TRAFFIC {k} b{b} size {size} rank {rank} sent {t.sent_bytes} fp32 {t.fp32_bytes}",
                      flush=True)
            prev = LAST["fp32"].get(k)
            if first and prev is not None and prev[0] != size:
                want = prev[1] * (2 * (size - 1) / size) / (2 * (prev[0] - 1) / prev[0])
                check(abs(t.fp32_bytes - want) <= 0.01 * want, f"traffic.{k}.b{b}",
                      f"fp32 model {prev[1]} B at {prev[0]} ranks -> {t.fp32_bytes} B at {size} "
                      f"(want {want:.0f})")
            LAST["fp32"][k] = (size, t.fp32_bytes)
    for k, opt in OPTS.items():
        if first and k in ("qsgd_auto", "stock_auto"):
            sc = None if k == "qsgd_auto" else _stock.state_of(opt)
            auto = opt._sched.auto if k == "qsgd_auto" else sc._groups[id(opt)][1].sched.auto
            route = opt.reduction_in_use() if k == "qsgd_auto" else sc.reduction_in_use(opt)
            check(auto.choice is None and route in AutoChoice.CANDIDATES and auto.step <= 1,
                  f"auto.measuring.{k}.b{b}", f"choice {auto.choice!r}, schedule step {auto.step}, "
                  f"next route {route}")
    mem = onebit_memory()
    if mem is not None:
        server = server_residuals(mem)
        if first:
            mine = [key for key in server if key[1:] == (rank, size)]
            check(mine, f"residuals.server_key.b{b}",
                  f"server residual keys at size {size}: {mine}; "
                  f"all sizes kept: {sorted({k[2] for k in server})}")
        LAST["worker"] = worker_residuals(mem)
        LAST["server"] = server
    LAST["size"] = size
    LAST["seen"].add((rank, size))


@hvd.elastic.run
def train(state):
    while state.batch < TOTAL:
        b, size = state.batch, hvd.size()
        next_phase(state, b, hvd.rank())
        first = LAST["size"] != size
        if first:
            before_step(b, size)
        check(size == SIZES[state.phase], f"size.b{b}", f"phase {state.phase} runs at {size} ranks")
        x, y = batch_for(b)
        for k, m in MODELS.items():
            opt = OPTS[k]
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        after_step(b, size, first)
        state.batch = b + 1
        state.commit()


t0 = time.monotonic()
train(state)
print(f"DONE rank {hvd.rank()}/{hvd.size()} batch {state.batch} in {time.monotonic() - t0:.1f}s", flush=True)
check.finish()
