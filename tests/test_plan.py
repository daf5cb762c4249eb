"""hvd_quant.plan in one process, no framework: which tensors are compressed, fusion boundaries,
explicit groups, bucket names, the handshake record, op mapping, argument checks and residual
checkpoints. Everything here is exact (integers, names, bytes, bit patterns): no tolerance applies."""
import struct

import numpy as np
import pytest

import hvd_quant
from hvd_quant import plan, scheduler
from hvd_quant.exchange import AVERAGE, SUM, ArrayOps, Memory, handshake_record

T = plan.Tensor

# Stand-ins for a framework's Horovod op constants (horovod.torch / horovod.tensorflow use 0, 1, 2).
AVG_C, SUM_C, ADASUM_C = 0, 1, 2

NUMPY_OPS = ArrayOps(
    flatten=lambda ts: np.concatenate([np.asarray(t, np.float32).reshape(-1) for t in ts]),
    zeros=lambda n, like: np.zeros(n, np.float32), empty=lambda n, like: np.empty(n, np.float32),
    slice=lambda buf, a, b: buf[a:b], empty_bytes=lambda n, like: np.empty(n, np.uint8),
    add_=lambda a, b: np.add(a, b, out=a), scale_=lambda a, s: np.multiply(a, s, out=a),
    numel=lambda t: int(np.size(t)),
    from_bytes=lambda b: np.frombuffer(b, np.uint8).copy(), to_bytes=lambda t: bytes(t),
    to_like=lambda t, like: t, clone=lambda t: np.array(t, copy=True))


def configure(compression, **kw):
    """plan.configure with the codec resolved as the frontends resolve ``compression=``."""
    return plan.configure(hvd_quant.codecs.resolve_codec(compression), **kw)


def cfg(**kw):
    kw.setdefault("compression", "qsgd:bits=4,bucket_size=512")
    return configure(kw.pop("compression"), **kw)


def fp(name, *shape):
    return T(name, tuple(shape), True)


# --------------------------------------------------------------------------------------------------
# Fusion and grouping


@pytest.mark.parametrize("numels,bucket_bytes,expected", [
    pytest.param([256, 256], 2048, [[0, 1]], id="exact-fit"),
    pytest.param([256, 257], 2048, [[0], [1]], id="one-element-over"),
    pytest.param([10, 1000, 10], 400, [[0], [1], [2]], id="larger-tensor-alone"),
    pytest.param([10, 20, 30, 40], 240, [[0, 1, 2], [3]], id="greedy-in-order"),
    pytest.param([5, 5, 5], 0, [[0, 1, 2]], id="zero-means-one-bucket"),
    pytest.param([5, 5, 5], None, [[0, 1, 2]], id="none-means-one-bucket"),
    pytest.param([1, 1], 3, [[0], [1]], id="under-one-float-means-one-element"),
    pytest.param([], 2048, [], id="empty"),
])
def test_fuse_boundaries(numels, bucket_bytes, expected):
    assert plan.fuse(range(len(numels)), dict(enumerate(numels)), bucket_bytes) == expected


# bucket_bytes 8 * 4 * TAIL_SHARE: groups of at most 8 * TAIL_SHARE floats, a tail of at most 8
@pytest.mark.parametrize("numels,expected", [
    pytest.param([50, 3, 3], [[0], [1, 2]], id="tail-of-last-group-fits"),
    pytest.param([40, 9, 4, 4], [[0, 1], [2, 3]], id="tail-stops-at-the-share"),
    pytest.param([5, 2, 2, 2], [[0], [1, 2, 3]], id="small-tensors-over-the-share"),
    pytest.param([30, 30, 9], [[0, 1], [2]], id="last-group-one-tensor-over-the-share"),
    pytest.param([2, 3, 50], [[0, 1, 2]], id="last-tensor-over-the-share-no-split"),
    pytest.param([3, 3, 2], [[0, 1, 2]], id="group-within-the-share-no-split"),
    pytest.param([64, 1], [[0], [1]], id="greedy-groups-kept"),
])
def test_fuse_buckets_splits_the_last_groups_tail(numels, expected):
    n = dict(enumerate(numels))
    got = plan.fuse_buckets(range(len(numels)), n, 8 * 4 * plan.TAIL_SHARE)
    assert got == expected
    assert sum(got, []) == list(range(len(numels)))
    assert plan.fuse_buckets(range(len(numels)), n, None) == [list(range(len(numels)))]


@pytest.mark.parametrize("n,parts", [(0, 2), (5, 2), (6, 3), (7, 3), (2, 4)])
def test_split_even_matches_horovods_split_list(n, parts):
    util = pytest.importorskip("horovod.common.util")
    assert plan.split_even(list(range(n)), parts) == util.split_list(list(range(n)), parts)


@pytest.mark.parametrize("tensor,config,expected", [
    pytest.param(fp("w", 32, 32), {}, True, id="2d-large"),
    pytest.param(fp("w", 32, 31), {"min_compress_numel": 1024}, False, id="below-min-numel"),
    pytest.param(fp("w", 1024), {}, False, id="1d"),
    pytest.param(fp("w", 1024), {"compress_1d": True}, True, id="1d-with-compress_1d"),
    pytest.param(T("w", (32, 32), False), {}, False, id="not-floating"),
    pytest.param(T("w", None, True), {}, False, id="unknown-shape"),
    pytest.param(fp("w", 32, 32), {"compression": None}, False, id="passthrough-codec"),
    pytest.param(fp("w", 32, 32), {"compression": "none"}, False, id="none-spec"),
    pytest.param(fp("w", 32, 32), {"compression": "fp16"}, True, id="fp16-is-compressed"),
])
def test_compressible(tensor, config, expected):
    c = cfg(**config)
    p = plan.make_plan(c, [tensor])
    assert c.compressible(tensor.shape, tensor.floating) is expected
    assert (p.compressed == (0,)) is expected and (p.plain == (0,)) is (not expected)


def test_plan_fuses_in_reverse_order_with_offsets():
    tensors = [fp("a", 64, 16), fp("bias", 16), fp("b", 32, 32), None, fp("c", 16, 16)]
    p = plan.make_plan(cfg(bucket_bytes=5 * 1024, min_compress_numel=1), tensors, prefix="px")
    assert [b.members for b in p.buckets] == [(4, 2), (0,)]
    assert p.plain == (1,) and p.compressed == (4, 2, 0)        # None: in neither
    b = p.buckets[0]
    assert b.names == ("c", "b") and b.shapes == ((16, 16), (32, 32))
    assert b.offsets == (0, 256, 1280) and b.numel == 1280 and b.numels == (256, 1024)
    assert p.compressed_numel == 1280 + 1024
    assert [b.index for b in p.buckets] == [0, 1]


@pytest.mark.parametrize("groups,expected", [
    pytest.param([[0, 2]], [(0, 2), (4, 3)], id="one-group-rest-fused-reversed"),
    pytest.param([[2, 0], [4]], [(2, 0), (4,), (3,)], id="order-within-group-kept"),
    pytest.param([[1, 0]], [(0,), (4, 3, 2)], id="plain-member-dropped"),
    pytest.param([[0], [0, 2]], [(0,), (2,), (4, 3)], id="tensor-in-two-groups-first-wins"),
    pytest.param([[1]], [(4, 3, 2, 0)], id="group-of-plain-only-vanishes"),
    pytest.param(2, [(0, 2), (3, 4)], id="count-splits-evenly-in-order"),
    pytest.param(3, [(0, 2), (3,), (4,)], id="count-longer-parts-first"),
    pytest.param(10, [(0,), (2,), (3,), (4,)], id="count-above-tensors"),
])
def test_groups(groups, expected):
    tensors = [fp("a", 8, 8), fp("bias", 8), fp("b", 8, 8), fp("c", 8, 8), fp("d", 8, 8)]
    p = plan.make_plan(cfg(bucket_bytes=0, min_compress_numel=1), tensors, groups)
    assert [b.members for b in p.buckets] == expected


def test_bucket_names_come_from_member_names():
    one = plan.make_plan(cfg(), [fp("w", 32, 32)], prefix="hvdq7").buckets[0]
    assert one.header == "w" and one.name == "hvdq7.w"
    tensors = [fp("x.weight", 32, 32), fp("y.weight", 32, 32), fp("z.weight", 32, 32)]
    a = plan.make_plan(cfg(), tensors, prefix="hvdq0").buckets[0]
    b = plan.make_plan(cfg(), tensors, prefix="hvdq1").buckets[0]
    assert a.header == b.header == f"z.weight..x.weight(3,{plan.digest(['z.weight', 'y.weight', 'x.weight'])})"
    assert (a.name, b.name) == ("hvdq0." + a.header, "hvdq1." + b.header)
    renamed = plan.make_plan(cfg(), [fp("x.weight", 32, 32), fp("q.weight", 32, 32),
                                     fp("z.weight", 32, 32)]).buckets[0]
    assert renamed.header != a.header          # a middle member's name changes the checksum


# --------------------------------------------------------------------------------------------------
# Configuration summary and handshake record

BASE = dict(compression="qsgd:bits=4,bucket_size=512", reduction="sra", bucket_bytes=4 << 20,
            min_compress_numel=1024, compress_1d=False, warmup_steps=0, error_feedback=None,
            op=AVERAGE, predivide=1.0, extra=(("backward_passes", 1),))
TENSORS = [fp("a", 64, 64), fp("bias", 64), fp("b", 128, 64), fp("c", 32, 32)]


def record(config=None, tensors=TENSORS, groups=None, prefix="hvdq"):
    return plan.make_plan(configure(**dict(BASE, **(config or {}))), tensors, groups, prefix).record


def test_record_is_identical_for_identical_configs():
    assert record() == record()                     # separate codec objects, equal configuration
    assert len(record()) == len(handshake_record("x"))
    assert configure(**BASE) == configure(**BASE)


@pytest.mark.parametrize("change", [
    pytest.param({"compression": "qsgd:bits=8,bucket_size=512"}, id="codec-bits"),
    pytest.param({"compression": "qsgd:bits=4,bucket_size=128"}, id="codec-bucket_size"),
    pytest.param({"compression": "onebit"}, id="codec-method"),
    pytest.param({"reduction": "allgather"}, id="reduction"),
    pytest.param({"bucket_bytes": 1 << 20}, id="bucket_bytes"),
    pytest.param({"min_compress_numel": 1000}, id="min_compress_numel"),
    pytest.param({"compress_1d": True}, id="compress_1d"),
    pytest.param({"warmup_steps": 1}, id="warmup_steps"),
    pytest.param({"error_feedback": True}, id="error_feedback"),
    pytest.param({"op": SUM, "predivide": 1.0}, id="op"),
    pytest.param({"predivide": 2.0}, id="predivide"),
    pytest.param({"extra": (("backward_passes", 2),)}, id="extra"),
])
def test_record_differs_when_a_config_field_differs(change):
    assert record(change) != record()


@pytest.mark.parametrize("kw", [
    pytest.param({"tensors": [fp("A", 64, 64)] + TENSORS[1:]}, id="a-name"),
    pytest.param({"tensors": [fp("a", 32, 128)] + TENSORS[1:]}, id="a-shape-same-numel"),
    pytest.param({"tensors": TENSORS[:1] + [fp("bias", 65)] + TENSORS[2:]}, id="a-plain-shape"),
    pytest.param({"tensors": TENSORS[1:] + TENSORS[:1]}, id="the-order"),
    pytest.param({"groups": [[0, 2]]}, id="groups"),
    pytest.param({"prefix": "hvdq1"}, id="exchange-prefix"),
])
def test_record_differs_when_the_layout_differs(kw):
    assert record(**kw) != record()


def test_summary_names_every_field_that_applies():
    assert configure(**BASE).summary() == (
        "qsgd:bits=4,bucket_size=512,mode=stochastic,norm=max reduction=sra bucket_bytes=4194304 "
        "min_compress_numel=1024 compress_1d=False warmup_steps=0 error_feedback=False op=average "
        "predivide=1.0 backward_passes=1")
    codec = hvd_quant.OneBit()
    stock = configure(codec, bucket_bytes=None, warmup_steps=None, op=None, predivide=None)
    assert stock.summary() == (f"{codec.spec()} reduction=sra min_compress_numel=1024 "
                               "compress_1d=False error_feedback=True")


# --------------------------------------------------------------------------------------------------
# Ops and argument checks


@pytest.mark.parametrize("op,expected", [
    pytest.param(None, AVERAGE, id="none-is-average"),
    pytest.param(AVG_C, AVERAGE, id="hvd.Average"),
    pytest.param(SUM_C, SUM, id="hvd.Sum"),
    pytest.param(AVERAGE, AVERAGE, id="core-average"),
    pytest.param(SUM, SUM, id="core-sum"),
])
def test_core_op(op, expected):
    assert plan.core_op(op, AVG_C, SUM_C, ADASUM_C) == expected


@pytest.mark.parametrize("op,message", [
    pytest.param(ADASUM_C, "op=hvd.Adasum is not supported: Adasum combines gradients pairwise",
                 id="adasum"),
    pytest.param(7, "unsupported op 7; use hvd.Average or hvd.Sum", id="unknown-constant"),
    pytest.param("min", "unsupported op 'min'; use hvd.Average or hvd.Sum", id="unknown-string"),
    pytest.param("0", "unsupported op '0'", id="string-never-equals-a-constant"),
])
def test_core_op_refuses(op, message):
    with pytest.raises(ValueError, match=message):
        plan.core_op(op, AVG_C, SUM_C, ADASUM_C)


@pytest.mark.parametrize("call,message", [
    pytest.param(lambda: configure("qsgd", reduction="ring"), "reduction must be one of",
                 id="reduction"),
    pytest.param(lambda: configure("qsgd", op=SUM, predivide=2.0),
                 "gradient_predivide_factor not supported with op != Average", id="predivide-with-sum"),
    pytest.param(lambda: plan.check_groups(0, "torch.Tensor"),
                 "groups should be a non-negative integer or a list of list of torch.Tensor", id="groups-0"),
    pytest.param(lambda: plan.check_groups(-1, "tf.Variable"), "list of list of tf.Variable",
                 id="groups-negative"),
    pytest.param(lambda: plan.check_backward_passes(0), "backward_passes_per_step must be > 0",
                 id="backward-passes"),
])
def test_arguments_refused(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("name,value,error", [
    ("bucket_bytes", -5, ValueError), ("bucket_bytes", float("nan"), ValueError),
    ("bucket_bytes", "1MB", ValueError), ("bucket_bytes", True, ValueError),
    ("min_compress_numel", -1, ValueError), ("warmup_steps", -3, ValueError),
    ("warmup_steps", 1.5, ValueError), ("error_feedback", "no", TypeError),
    ("error_feedback", 0, TypeError), ("compress_1d", "yes", TypeError),
])
def test_settings_refused_by_name(name, value, error):
    """A setting that would otherwise pass silently (``bool("no")`` is True; a negative size or step
    count) is refused, naming the argument, before any rank talks to another."""
    with pytest.raises(error, match=f"^{name} must be"):
        configure("qsgd", **{name: value})


@pytest.mark.parametrize("name,value,expected", [
    ("bucket_bytes", 2.5e7, 25_000_000), ("bucket_bytes", np.int64(4096), 4096), ("bucket_bytes", 0, 0),
    ("warmup_steps", np.int32(3), 3), ("error_feedback", np.bool_(True), True),
])
def test_settings_accepted(name, value, expected):
    got = getattr(configure("qsgd", **{name: value}), name)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("compression,error_feedback,expected", [
    pytest.param("onebit", None, True, id="onebit-wants-it"),
    pytest.param("qsgd", None, False, id="qsgd-does-not"),
    pytest.param("qsgd", True, True, id="asked-for"),
    pytest.param("onebit", False, False, id="refused"),
])
def test_error_feedback_default_is_the_codecs_wish(compression, error_feedback, expected):
    assert configure(compression, error_feedback=error_feedback).error_feedback is expected


@pytest.mark.parametrize("op,predivide,factors", [
    pytest.param(AVERAGE, 1.0, (1.0, 1.0), id="average"),
    pytest.param(AVERAGE, 4.0, (0.25, 4.0), id="average-predivide"),
    pytest.param(SUM, 1.0, (1.0, 1.0), id="sum"),
])
def test_scale_factors(op, predivide, factors):
    assert configure("qsgd", op=op, predivide=predivide).allreduce_factors() == factors


@pytest.mark.parametrize("given,expected", [
    pytest.param(hvd_quant.QSGD(bits=4), hvd_quant.QSGD(bits=4), id="codec"),
    pytest.param("qsgd:bits=4,bucket_size=512", hvd_quant.QSGD(bits=4, bucket_size=512), id="spec"),
    pytest.param("onebit", hvd_quant.OneBit(), id="name"),
    pytest.param(None, hvd_quant.NoCompression(), id="none"),
])
def test_stock_compression_takes_what_compression_takes(given, expected):
    sc = hvd_quant.StockCompression(given, reduction="allgather")
    assert sc.codec == expected and hvd_quant.StockCompression(sc).codec == expected
    assert sc.config == configure(expected, reduction="allgather", bucket_bytes=plan.BUCKET_BYTES,
                                  warmup_steps=None, op=None, predivide=None)


# --------------------------------------------------------------------------------------------------
# Residual checkpoints


def _memory_of(p, seed):
    rng = np.random.default_rng(seed)
    mem = Memory(NUMPY_OPS)
    for b in p.buckets:
        mem.set(Memory.WORKER, b.name, rng.standard_normal(b.numel).astype(np.float32))
        mem.set(Memory.SERVER, (b.name, 1, 3), rng.standard_normal(b.numel // 3).astype(np.float32))
    return mem


def _copy(a):
    return np.array(a, np.float32, copy=True)


def _join(arrays):
    return np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays])


TENSORS_EF = [fp("a", 16, 16), fp("b", 32, 8), fp("c", 8, 8), fp("d", 24, 8)]


def test_residuals_save_per_name_and_restore_bit_exactly():
    p = plan.make_plan(cfg(bucket_bytes=2048, min_compress_numel=1), TENSORS_EF, prefix="hvdq3")
    mem = _memory_of(p, 0)
    worker, server = plan.save_residuals(mem, p.buckets, _copy)
    assert sorted(worker) == ["a", "b", "c", "d"]
    assert all(worker[t.name].shape == t.shape for t in TENSORS_EF)
    assert sorted(server) == sorted((b.header, 1, 3) for b in p.buckets)
    # Into another instance (another prefix): the same bits.
    q = plan.make_plan(cfg(bucket_bytes=2048, min_compress_numel=1), TENSORS_EF, prefix="hvdq9")
    mem2 = Memory(NUMPY_OPS)
    w, s = dict(worker), dict(server)
    plan.restore_residuals(mem2, q.buckets, w, s, _join)
    assert w == {} and s == {}
    for bp, bq in zip(p.buckets, q.buckets):
        assert mem2.get(Memory.WORKER, bq.name).tobytes() == mem.get(Memory.WORKER, bp.name).tobytes()
        assert (mem2.get(Memory.SERVER, (bq.name, 1, 3)).tobytes()
                == mem.get(Memory.SERVER, (bp.name, 1, 3)).tobytes())


def test_worker_residuals_survive_another_bucketing():
    p = plan.make_plan(cfg(bucket_bytes=2048, min_compress_numel=1), TENSORS_EF)
    worker, server = plan.save_residuals(_memory_of(p, 1), p.buckets, _copy)
    q = plan.make_plan(cfg(bucket_bytes=0, min_compress_numel=1), TENSORS_EF)
    mem = Memory(NUMPY_OPS)
    s = dict(server)
    plan.restore_residuals(mem, q.buckets, dict(worker), s, _join)
    (b,) = q.buckets
    flat = mem.get(Memory.WORKER, b.name)
    for k, name in enumerate(b.names):
        assert flat[b.offsets[k]:b.offsets[k + 1]].tobytes() == worker[name].tobytes()
    assert s == server          # the server residuals belong to buckets that no longer exist: left


def test_incomplete_bucket_is_not_restored_and_wrong_size_raises():
    p = plan.make_plan(cfg(bucket_bytes=0, min_compress_numel=1), TENSORS_EF)
    worker, _ = plan.save_residuals(_memory_of(p, 2), p.buckets, _copy)
    mem = Memory(NUMPY_OPS)
    partial = {k: v for k, v in worker.items() if k != "c"}
    plan.restore_residuals(mem, p.buckets, partial, {}, _join)
    assert mem.names(Memory.WORKER) == [] and sorted(partial) == ["a", "b", "d"]
    worker["c"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="elements"):
        plan.restore_residuals(mem, p.buckets, worker, {}, _join)


def test_auto_choice_schedule_and_decision():
    """AutoChoice: warm-up of every candidate (untimed), then interleaved timed trials; the choice is
    the candidate with the lowest median, ties to the earlier one (Horovod's allreduce first)."""
    from hvd_quant.exchange import Collectives
    cost = {"allreduce": 3.0, "allgather": 1.0, "sra": 2.0}
    now = [0.0]
    auto = scheduler.AutoChoice(trials=3, clock=lambda: now[0])
    seen = []
    while auto.choice is None:
        used = auto.current()
        seen.append(used)
        now[0] += cost[used] + (100.0 if len(seen) <= 3 else 0.0)     # warm-up steps are not timed
        if auto.end_step():
            coll = Collectives(rank=0, size=1, allgather_async=None, alltoall_async=None,
                               allreduce_async=None, synchronize=None)
            auto.decide(coll, None, "unused")
    assert seen[:3] == ["sra", "allgather", "allreduce"]
    assert sorted(seen[3:]) == sorted(["allreduce", "allgather", "sra"] * 3)
    assert auto.choice == "allgather" and auto.current() == "allgather"
    assert auto.medians == [3.0, 1.0, 2.0]
    assert not auto.end_step()                 # decided: nothing more is timed
    auto.reset()
    assert auto.choice is None and auto.current() == "sra"
    tie = scheduler.AutoChoice(trials=1, clock=lambda: 0.0)
    while not tie.end_step():
        pass
    tie.decide(coll, None, "unused")
    assert tie.choice == "allreduce"            # equal times: no compression
    # a compressed way is taken only where it measured at least `margin` (10%) faster
    near = scheduler.AutoChoice()
    assert near.choose(struct.pack("<3d", 1.0, 0.91, 0.95)) == "allreduce"
    assert near.choose(struct.pack("<3d", 1.0, 0.95, 0.89)) == "sra"
    assert near.choose(struct.pack("<6d", 1.0, 0.86, 0.95, 1.0, 0.98, 0.95)) == "allreduce"  # 0.92
    assert near.choose(struct.pack("<6d", 1.0, 0.8, 0.9, 1.0, 0.95, 0.9)) == "allgather"


def test_auto_choice_waits_for_the_device_before_timing():
    """end_step(wait=...) waits first (on CUDA, for the device's queued work) and then reads the clock,
    at every step of the schedule; once the choice is made, nothing is waited for."""
    from hvd_quant.exchange import Collectives
    events = []
    auto = scheduler.AutoChoice(trials=1, clock=lambda: events.append("clock") or 0.0)
    while not auto.end_step(wait=lambda: events.append("wait")):
        pass
    assert events == ["wait", "clock"] * len(auto.schedule)
    coll = Collectives(rank=0, size=1, allgather_async=None, alltoall_async=None,
                       allreduce_async=None, synchronize=None)
    auto.decide(coll, None, "unused")
    events.clear()
    assert not auto.end_step(wait=lambda: events.append("wait")) and events == []


def test_in_plan_order():
    """Buckets that start in plan order: the run from next_start starts, the rest waits for it."""
    from hvd_quant.scheduler import in_plan_order
    assert in_plan_order([1], 0) == ([], [1], 0)               # 1 waits for 0
    assert in_plan_order([1, 0, 3], 0) == ([0, 1], [3], 2)     # 0 and 1 go; 3 waits for 2
    assert in_plan_order([2], 2) == ([2], [], 3)
    assert in_plan_order([], 4) == ([], [], 4)


# --------------------------------------------------------------------------------------------------
# The step scheduler, with a stand-in exchange and collectives (world size 2, every rank's gradient
# the same: the exchange's sum is 2 x the gradient)


class _FakeExchange:
    def __init__(self, log):
        self.log = log

    def start(self, name, flat, step=None, record=None, header=None, channel=None):
        self.log.append(("start", name, channel))
        return {"name": name, "sum": flat * 2}

    def advance_ready(self, pendings):
        pass

    def advance(self, p):
        self.log.append(("advance", p["name"]))

    def finish(self, p):
        return p["sum"]


def _scheduler(present=2, channel=None):
    """A scheduler of buckets (d, b) and (a,) and one plain group (c), its log of collectives."""
    from hvd_quant.exchange import Collectives, Traffic
    log = []

    def allreduce(t, name, op=None, pre=1.0, post=1.0):
        log.append(("allreduce", name))
        return np.int64(present) if name == "present" else np.asarray(t) * 2

    config = cfg(reduction="sra", bucket_bytes=4 * 2000, min_compress_numel=10)
    p = plan.make_plan(config, [fp("a", 40, 40), fp("b", 30, 30), fp("c", 5), fp("d", 20, 20)])
    assert [b.names for b in p.buckets] == [("d", "b"), ("a",)] and p.plain == (2,)
    s = scheduler.StepScheduler(
        p, [("plain.0", [5])], ops=NUMPY_OPS, exchange_for=lambda route: _FakeExchange(log),
        traffic=Traffic(), numbering=lambda b: (0, None),
        split=lambda flat, numels: np.split(flat, np.cumsum(numels)[:-1]),
        presence=scheduler.Presence("present", lambda: np.ones(1)))
    s.bind(Collectives(rank=0, size=2, allgather_async=None, alltoall_async=None,
                       allreduce_async=allreduce, synchronize=lambda h: h))
    if channel is not None:
        s.channel = (s.coll, channel)
        s.routes_run.add("sra")
    return s, log


def _grads():
    return {n: np.full(numel, v, np.float32) for n, numel, v in
            (("a", 1600, 1.0), ("b", 900, 2.0), ("c", 5, 3.0), ("d", 400, 4.0))}


@pytest.mark.parametrize("channel", [None, "channel"])
def test_scheduler_starts_complete_buckets_in_plan_order_on_a_channel(channel):
    """Bucket 1 completes first: without a channel it starts at once; on one (collectives matched
    by order) it waits for bucket 0. A member that never arrived (b) contributes zeros; results are
    the sums scaled by 1/N (Average)."""
    s, log = _scheduler(channel=channel)
    g = _grads()
    assert s.begin_step() and log == [("allreduce", "present")]
    s.arrive(1, 0, g["a"])
    s.arrive(0, 0, g["d"])
    started = [e[1] for e in log if e[0] == "start"]
    assert started == (["hvdq.a"] if channel is None else [])
    pieces = s.result(0)
    assert [float(x[0]) for x in pieces] == [4.0, 0.0] and s.routes[0] == "sra"
    s.take(0, 2)
    assert [float(x[0]) for x in s.result(1)] == [1.0]
    started = [e[1:] for e in log if e[0] == "start"]
    want = [("hvdq.a", None), ("hvdq.d..b(2,1253ae5c)", None)] if channel is None else \
        [("hvdq.d..b(2,1253ae5c)", channel), ("hvdq.a", channel)]
    assert started == want and s.routes == ["sra", "sra"]
    s.arrive(2, 0, g["c"])                                          # plain group 0: group 2
    assert [float(x[0]) for x in s.result(2)] == [6.0]            # plain_op: a Sum by default


def test_scheduler_sends_buckets_through_allreduce_while_a_rank_joined():
    """The presence count says one of two ranks steps: every bucket goes through one Sum allreduce
    (a joined rank takes part in allreduces only), scaled as the exchange's result."""
    s, log = _scheduler(present=1)
    g = _grads()
    s.begin_step()
    s.arrive(0, 0, g["d"])
    s.arrive(0, 1, g["b"])
    s.arrive(1, 0, g["a"])
    assert not any(e[0] == "start" for e in log)
    assert ("allreduce", "hvdq.d..b(2,1253ae5c).sum") in log and ("allreduce", "hvdq.a.sum") in log
    assert [float(x[0]) for x in s.result(0)] == [4.0, 2.0] and s.routes == ["allreduce"] * 2
