"""The exchange's logic in one process: N simulated ranks in lockstep, real codecs, torch tensors.

``SimWorld`` implements the :class:`hvd_quant.exchange.Collectives` table for N ranks living in this
process: a collective's result is computed once every rank has submitted it, which the exchange's
phases allow (start all, advance all, finish all). The real collectives are covered by
tests/test_exchange_multiproc.py; these tests cover sizes, rank counts and error paths cheaply.
"""
import pytest

torch = pytest.importorskip("torch")

import hvd_quant  # noqa: E402
from hvd_quant.exchange import (ConfigMismatchError, Collectives, Exchange, PayloadMismatchError,  # noqa: E402
                                chunk_bounds, check_handshake, handshake_record)
from hvd_quant.exchange import Memory  # noqa: E402
from hvd_quant.torch import _backend  # noqa: E402  (imports horovod.torch; no init needed)

pytestmark = pytest.mark.torch
OPS = _backend.OPS


class SimWorld:
    def __init__(self, n):
        self.n = n
        self.subs = {}      # name -> {rank: (kind, tensor, splits)}
        self.log = []       # (rank, kind, name, nbytes sent to others)

    def _submit(self, rank, kind, name, t, splits=None):
        self.subs.setdefault(name, {})[rank] = (kind, t, splits)
        return (name, rank)

    def sync(self, handle):
        name, rank = handle
        subs = self.subs[name]
        assert len(subs) == self.n, f"{name}: only ranks {sorted(subs)} submitted"
        kinds = {k for k, _, _ in subs.values()}
        assert len(kinds) == 1, f"{name}: mixed collectives {kinds}"
        kind = kinds.pop()
        if kind == "allgather":
            return torch.cat([subs[j][1] for j in range(self.n)])
        if kind == "alltoall":
            parts = []
            for j in range(self.n):
                _, t, splits = subs[j]
                off = sum(splits[:rank])
                parts.append(t[off:off + splits[rank]])
            return torch.cat(parts)
        raise AssertionError(kind)

    def coll(self, rank):
        return Collectives(
            rank=rank, size=self.n,
            allgather_async=lambda t, name, sizes=None: self._submit(rank, "allgather", name, t),
            alltoall_async=lambda t, splits, name: self._submit(rank, "alltoall", name, t, list(splits)),
            allreduce_async=None, synchronize=self.sync)


def run(world, specs, xs, reduction, memories=None, headers=None, records=None, name="t", step=0):
    exs = [Exchange(hvd_quant.from_spec(specs[r]), world.coll(r), OPS, reduction=reduction,
                    memory=None if memories is None else memories[r]) for r in range(world.n)]
    ps = [ex.start(name, xs[r].clone(), step=step,
                   header=None if headers is None else headers[r],
                   record=None if records is None else records[r]) for r, ex in enumerate(exs)]
    for ex, p in zip(exs, ps):
        ex.advance(p)
    return [ex.finish(p) for ex, p in zip(exs, ps)], exs


@pytest.mark.parametrize("n,size,align", [(0, 3, 512), (1, 3, 512), (513, 2, 512), (5000, 4, 128),
                                          (7, 5, 1), (2048, 3, 512)])
def test_chunk_bounds_cover_and_align(n, size, align):
    b = chunk_bounds(n, size, align)
    assert len(b) == size and b[0][0] == 0 and b[-1][1] == n
    for (a0, b0), (a1, _) in zip(b, b[1:]):
        assert b0 == a1 and a0 <= b0
    for a, _ in b:
        assert a % align == 0 or a == n


@pytest.mark.parametrize("reduction", ["sra", "allgather"])
@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
@pytest.mark.parametrize("n", [1, 511, 513, 4000])
def test_deterministic_qsgd_within_bound_and_identical(reduction, ranks, n):
    spec = "qsgd:bits=4,bucket_size=512,mode=deterministic"
    g = torch.Generator().manual_seed(n * 10 + ranks)
    xs = [torch.randn(n, generator=g) for _ in range(ranks)]
    outs, _ = run(SimWorld(ranks), [spec] * ranks, xs, reduction)
    for o in outs[1:]:
        assert torch.equal(o, outs[0])
    # |error| <= unit/2 per quantization; unit = bucket max / 7; SRA quantizes twice (the second time a
    # chunk whose max is at most the sum of the ranks' maxima).
    nb = -(-n // 512)
    m = torch.zeros(nb, dtype=torch.float64)
    for x in xs:
        pad = torch.zeros(nb * 512, dtype=torch.float64)
        pad[:n] = x.double().abs()
        m += pad.view(nb, 512).amax(1)
    q = 1 if reduction == "allgather" else 2
    bound = (q * m / 7 / 2 * (1 + 1e-5)).repeat_interleave(512)[:n]
    err = (outs[0].double() - sum(x.double() for x in xs)).abs()
    assert bool((err <= bound).all()), float((err / bound).max())


def test_sra_error_feedback_keeps_worker_and_server_residuals():
    spec = "onebit:bucket_size=64"
    world = SimWorld(3)
    mems = [Memory(OPS) for _ in range(3)]
    xs = [torch.randn(1000) for _ in range(3)]
    run(world, [spec] * 3, xs, "sra", memories=mems)
    for r, mem in enumerate(mems):
        assert mem.names(Memory.WORKER) == ["t"] and mem.names(Memory.SERVER) == [("t", r, 3)]
        assert mem.get(Memory.WORKER, "t").numel() == 1000
        a, b = chunk_bounds(1000, 3, 64)[r]
        assert mem.get(Memory.SERVER, ("t", r, 3)).numel() == b - a
        # residual = compensated - decoded(own payload): re-derive it for the first chunk
        c = hvd_quant.from_spec(spec)
        a, b = chunk_bounds(1000, 3, 64)[0]
        dec = c.decode(c.encode(xs[r][a:b].clone(), name="x"))
        assert torch.allclose(mem.get(Memory.WORKER, "t")[a:b], xs[r][a:b] - dec.reshape(-1))


def test_error_feedback_sums_to_the_truth_over_steps():
    """With EF, the sum of exchanged gradients tracks the sum of true gradients (residuals bounded)."""
    spec = "onebit:bucket_size=64"
    world = SimWorld(2)
    mems = [Memory(OPS) for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    true_sum = torch.zeros(512, dtype=torch.float64)
    got_sum = torch.zeros(512, dtype=torch.float64)
    for step in range(200):
        xs = [torch.randn(512, generator=g) + 0.5 for _ in range(2)]
        outs, _ = run(world, [spec] * 2, xs, "sra", memories=mems, name="s", step=step)
        world.subs.clear()
        true_sum += sum(x.double() for x in xs)
        got_sum += outs[0].double()
    drift = float((got_sum - true_sum).abs().mean())
    assert drift < 0.05 * float(true_sum.abs().mean()), drift


@pytest.mark.parametrize("reduction", ["sra", "allgather"])
def test_wrong_tensor_payload_raises_on_every_rank(reduction):
    world = SimWorld(2)
    specs = ["qsgd:bits=4"] * 2
    xs = [torch.randn(3000) for _ in range(2)]
    exs = [Exchange(hvd_quant.from_spec(s), world.coll(r), OPS, reduction=reduction)
           for r, s in enumerate(specs)]
    ps = [ex.start("t", x, header=f"other{r}") for r, (ex, x) in enumerate(zip(exs, xs))]
    for ex, p in zip(exs, ps):
        with pytest.raises(ValueError, match="(?i)name"):
            ex.finish(p)


@pytest.mark.parametrize("reduction", ["sra", "allgather"])
def test_size_mismatch_raises_on_every_rank(reduction):
    world = SimWorld(2)
    exs = [Exchange(hvd_quant.from_spec("qsgd:bits=4"), world.coll(r), OPS, reduction=reduction)
           for r in range(2)]
    ps = [ex.start("t", torch.randn(1000 + 3000 * r)) for r, ex in enumerate(exs)]
    for ex, p in zip(exs, ps):
        with pytest.raises(PayloadMismatchError, match="expected"):
            ex.finish(p)


def test_handshake_names_every_rank_configuration():
    recs = [handshake_record("qsgd:bits=4 reduction=sra"), handshake_record("qsgd:bits=8 reduction=sra")]
    world = SimWorld(2)
    gathered = torch.cat([OPS.from_bytes(r) for r in recs])
    for r in range(2):
        with pytest.raises(ConfigMismatchError, match="configured differently") as e:
            check_handshake(world.coll(r), OPS, recs[r], gathered, "test")
        assert "rank 0: qsgd:bits=4" in str(e.value) and "rank 1: qsgd:bits=8" in str(e.value)
    same = torch.cat([OPS.from_bytes(recs[0])] * 2)
    check_handshake(world.coll(0), OPS, recs[0], same, "test")
    # Same summary, different layout details: still refused, with a hint.
    a, b = handshake_record("s", ("w", 10)), handshake_record("s", ("w", 11))
    with pytest.raises(ConfigMismatchError, match="parameter layout"):
        check_handshake(world.coll(0), OPS, a, torch.cat([OPS.from_bytes(a), OPS.from_bytes(b)]), "t")


@pytest.mark.parametrize("ns,key", [pytest.param(Memory.WORKER, "w", id="worker"),
                                    pytest.param(Memory.SERVER, ("w", 1, 2), id="server")])
def test_memory_state_roundtrip_is_exact(ns, key):
    mem = Memory(OPS)
    x = torch.randn(100)
    mem.set(ns, key, x.clone())
    state = mem.state_dict()
    mem2 = Memory(OPS)
    mem2.load_state_dict(state)
    assert torch.equal(mem2.get(ns, key), x)
    other = Memory.SERVER if ns == Memory.WORKER else Memory.WORKER
    assert mem2.names(other) == [] and mem2.get(other, key) is None     # namespaces are apart
    state[ns][key].add_(1)     # a copy: the memory is not aliased to the saved state
    assert torch.equal(mem2.get(ns, key), x)
    with pytest.raises(ValueError, match="elements"):
        mem2.compensate(ns, key, torch.zeros(99))


def test_memory_refuses_unknown_namespace():
    with pytest.raises(ValueError, match="namespace"):
        Memory(OPS).get("/server", "w")


def _profile_step(exs, x, step):
    """(kernel launches, Python calls into hvd_quant / numba_kernels) per rank for one step of every
    rank's exchange, counted by a profiler hook: a launch is a call from hvd_quant's code into the
    kernel layer (one prepared launch each)."""
    import sys
    counts = {"launches": 0, "calls": 0}
    ours = ("hvd_quant", "numba_kernels")

    def hook(frame, event, arg):
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if mod.startswith(ours):
            counts["calls"] += 1
            caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
            if mod in ("numba_kernels.cpu", "numba_kernels.cuda") and caller.startswith("hvd_quant"):
                counts["launches"] += 1

    xs = [x.clone() for _ in exs]
    sys.setprofile(hook)
    try:
        ps = [ex.start("bucket", xr, step=step) for ex, xr in zip(exs, xs)]
        for ex, p in zip(exs, ps):
            ex.advance(p)
        for ex, p in zip(exs, ps):
            ex.finish(p)
    finally:
        sys.setprofile(None)
    return counts["launches"] / len(exs), counts["calls"] / len(exs)


@pytest.mark.parametrize("n", [1, 2, 3])
@pytest.mark.parametrize("spec", ["qsgd:bits=4,bucket_size=512,seed=1", "onebit:bucket_size=64"])
@pytest.mark.parametrize("reduction", ["sra", "allgather"])
def test_steady_state_step_is_one_launch_per_phase(reduction, spec, n):
    """The hot path's budget (DESIGN.md, "The step-time budget"): after the first step (plans,
    compilation), one rank's step of one bucket is one launch per phase -- allgather: encode +
    decode_sum; SRA: the n chunk encodes + reduce_requantize + decode_chunks (3 at world size 1) --
    and a few dozen Python calls, error feedback included."""
    world = SimWorld(n)
    codec = hvd_quant.from_spec(spec)
    exs = [Exchange(codec, world.coll(r), OPS, reduction=reduction, memory=Memory(OPS)) for r in range(n)]
    x = torch.randn(3 * 4096 + 100)
    for step in range(2):
        _profile_step(exs, x, step)
        world.subs.clear()
    launches, calls = _profile_step(exs, x, 2)
    assert launches == (2 if reduction == "allgather" else n + 2), launches
    assert calls <= 56 + 24 * n, calls
