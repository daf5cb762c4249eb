"""Worker: averaged gradients through every TensorFlow entry point, against exact averages.

Every rank builds every rank's gradients from seeds (so it knows the exact float64 average and the
per-bucket maxima), each rank feeds its own through one entry point, and checks:

* error bound: |result - exact average| <= the codec's bound (tests/workers/tf_common.py ``bound``
  derives it: QSGD unit/s per quantization, one quantization for allgather and two for SRA, ...).
  Tensors the plan leaves uncompressed (1-D, small) must match Horovod's fp32 allreduce to float32
  rounding;
* bit-identical results on every rank (one allgather of every result's bytes at the end);
* fewer bytes: the traffic model of the step (``bytes_sent_per_step``) against fp32.

Entry points, each with qsgd 8-bit deterministic, qsgd 4-bit stochastic, onebit (bucket 128) and
fp16, and reduction sra and allgather:

  core      the core ``Exchange`` on the eager tables (``hvd_quant.tensorflow.collectives`` / ``OPS``)
  stock     ``hvd.allreduce(eager tensor, compression=...)`` (eager, named)
  stocktape ``hvd.DistributedGradientTape(tape, compression=...)`` (Horovod's tf.function: graph mode)
  stockv1   ``hvd.DistributedOptimizer(tf.compat.v1 optimizer, compression=...)`` compute_gradients
  stockkeras ``horovod.tensorflow.keras.DistributedOptimizer(..., compression=...)`` compute_gradients
  tape      ``hvd_quant.tensorflow.DistributedGradientTape`` (eager call)
  tapefn    the same inside a user ``tf.function``
  v1        ``hvd_quant.tensorflow.DistributedOptimizer(tf.compat.v1 optimizer)``
  keras     ``hvd_quant.tensorflow.keras.DistributedOptimizer`` compute_gradients
  stockauto the stock tape with ``reduction="auto"`` (once, 4-bit QSGD: :func:`run_stockauto`)

Gradients are made exact: loss = sum(v * g_r) has gradient g_r with respect to v.
"""
import sys
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
import horovod.tensorflow.keras as hvdk

hvd.init()

import hvd_quant  # noqa: E402
import hvd_quant.tensorflow as hqt  # noqa: E402
import hvd_quant.tensorflow.keras as hqk  # noqa: E402
from hvd_quant.tensorflow import _graph as tf_graph  # noqa: E402
from hvd_quant.exchange import Exchange  # noqa: E402
from tf_common import Checks, bound, same_on_all_ranks, FP32_EPS  # noqa: E402

check = Checks()
R, N = hvd.rank(), hvd.size()

SPECS = ["qsgd:bits=8,bucket_size=128,mode=deterministic",
         "qsgd:bits=4,bucket_size=128,mode=stochastic,seed=7",
         "onebit:bucket_size=128",
         "sortquant:bits=4,split_bits=2,bucket_size=128,mode=deterministic",
         "kmeans:bits=4,iters=4,bucket_size=128",
         "fp16"]
REDUCTIONS = ["sra", "allgather"]
# (name, shape, dtype): two compressible matrices (sizes multiples of the bucket size, so the fused
# buffer's buckets are those of each tensor), a bias (1-D: uncompressed), a small matrix (< 1024).
SHAPES = [("w1", (64, 32)), ("w2", (16, 64)), ("b1", (32,)), ("small", (8, 8))]
RESULTS = []       # every result, for the cross-rank byte comparison


def grads_of(case, dtype=np.float32):
    """Every rank's gradients for ``case``: list (rank) of list (tensor) of float64 arrays."""
    out = []
    for j in range(N):
        rs = np.random.RandomState(1000 * j + case)
        g = [(rs.randn(*shape) * (1.0 + j)).astype(dtype).astype(np.float64) for _, shape in SHAPES]
        out.append(g)
    return out


def compressed(name):
    return name in ("w1", "w2")


def verify(label, spec, reduction, codec, got, allg):
    """got: this rank's results (list aligned with SHAPES); allg: every rank's inputs."""
    RESULTS.extend(np.asarray(g) for g in got)
    worst = 0.0
    ok = True
    for k, (name, shape) in enumerate(SHAPES):
        xs = [allg[j][k].reshape(-1) for j in range(N)]
        exact = sum(xs) / N
        g = np.asarray(got[k], np.float64).reshape(-1)
        if compressed(name):
            b = bound(spec, reduction, xs, codec)
        else:       # uncompressed: Horovod's fp32 allreduce
            b = sum(np.abs(x) for x in xs) * FP32_EPS * 4 + 1e-30
        err = np.abs(g - exact)
        r = float((err / b).max())
        worst = max(worst, r)
        ok &= bool((err <= b).all()) and g.shape == exact.shape
    check(ok, f"bound {label} {spec} {reduction}", f"max error/bound {worst:.3f}")


def variables():
    return [tf.Variable(tf.zeros(shape), name=name) for name, shape in SHAPES]


def loss_fn(vs, mine):
    return tf.add_n([tf.reduce_sum(v * tf.constant(g, tf.float32)) for v, g in zip(vs, mine)])


def codec_of(spec):
    return hvd_quant.from_spec(spec)


# -- entry points --------------------------------------------------------------------------------------

def run_core(spec, reduction, case):
    allg = grads_of(case)
    codec = codec_of(spec)
    ex = Exchange(codec, hqt.collectives(), hqt.OPS, reduction=reduction, prefix=f"core{case}")
    got = []
    for k, (name, shape) in enumerate(SHAPES):
        p = ex.start(f"{name}", hqt.OPS.flatten([allg[R][k].astype(np.float32)]), step=0)
        got.append(hqt.OPS.scale_(ex.finish(p), 1.0 / N).reshape(shape))
    # core has no plan: every tensor is compressed; check against the codec bound for all
    worst, ok = 0.0, True
    for k in range(len(SHAPES)):
        xs = [allg[j][k].reshape(-1) for j in range(N)]
        err = np.abs(got[k].reshape(-1) - sum(xs) / N)
        b = bound(spec, reduction, xs, codec)
        if not spec.startswith("fp16"):
            b = np.maximum(b, 0)
        worst = max(worst, float((err / b).max()))
        ok &= bool((err <= b).all())
    RESULTS.extend(got)
    check(ok, f"bound core {spec} {reduction}", f"max error/bound {worst:.3f}")
    t = ex.traffic
    if not spec.startswith("fp16"):
        check(t.ratio > 1.9, f"bytes core {spec} {reduction}", f"fp32/sent = {t.ratio:.2f}")


def run_stock(spec, reduction, case):
    allg = grads_of(case)
    comp = hvd_quant.StockCompression(codec_of(spec), reduction=reduction)
    got = [hvd.allreduce(tf.constant(allg[R][k], tf.float32), compression=comp,
                         name=f"stock.{case}.{name}").numpy()
           for k, (name, _) in enumerate(SHAPES)]
    verify("stock", spec, reduction, comp.codec, got, allg)
    ratio = comp.traffic.ratio
    if not spec.startswith("fp16"):
        check(ratio > 1.9, f"bytes stock {spec} {reduction}", f"fp32/sent = {ratio:.2f}")


def run_stocktape(spec, reduction, case):
    allg = grads_of(case)
    comp = hvd_quant.StockCompression(codec_of(spec), reduction=reduction)
    vs = variables()
    for step in range(2):            # the second step reuses the trace
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, allg[R])
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        got = [g.numpy() for g in tape.gradient(loss, vs)]
        verify(f"stocktape.step{step}", spec, reduction, comp.codec, got, allg)
    # Fused: the two compressible gradients travel in one bucket, named after the variables found
    # in Horovod's frames (reverse order, as backward makes them): one exchange per step, not two
    bucket = "hvdq.stock.w2:0..w1:0"
    started = tf_graph._engine(comp, hvd.global_process_set).steps
    check([k.split("(")[0] for k in started] == [bucket] and list(started.values()) == [2],
          f"stocktape one exchange per step {spec} {reduction}", str(started))
    if comp.error_feedback:       # residuals are keyed by the bucket's exchange name
        names = [k.split("(")[0] for s in comp.state_dict()["residuals"].values() for k in s]
        check(names == [bucket], f"stocktape residual names {spec} {reduction}", str(names))


def run_stockauto():
    """reduction="auto" on the stock tape: AutoChoice's schedule (each way once to warm up, then 5
    timed steps of each, interleaved: 18 steps), then one choice taken alike on every rank from the
    allgathered medians. Every step's result within the codec's bound (SRA's, the widest of the
    three ways), each compressed way's exchange run exactly as often as the schedule says."""
    spec = "qsgd:bits=4,bucket_size=128,mode=stochastic,seed=7"
    allg = grads_of(700)
    comp = hvd_quant.StockCompression(codec_of(spec), reduction="auto")
    vs = variables()
    steps = 20
    for step in range(steps):
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, allg[R])
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        verify(f"stockauto.step{step}", spec, "sra", comp.codec, [g.numpy() for g in tape.gradient(loss, vs)],
               allg)
    (auto,) = tf_graph._AUTOS[comp].values()
    cands = list(auto.CANDIDATES)
    choice = auto.choice.choice
    mine = cands.index(choice) if choice in cands else -1
    every = hvd.allgather(tf.constant([mine], tf.int32), name="stockauto.choice").numpy().tolist()
    check(mine >= 0 and every == [mine] * N, "stockauto same choice on every rank", f"{every} {choice}")
    sched = 3 + 3 * 5
    for red in ("allgather", "sra"):
        started = list(tf_graph._engine(comp, hvd.global_process_set, red).steps.values())
        want = [6 + (steps - sched) * (choice == red)]
        check(started == want, f"stockauto {red} exchanges", f"{started}, expected {want}")
    # the choice travels in state_dict(): a restored compression takes it from its first step on
    again = hvd_quant.StockCompression(codec_of(spec), reduction="auto")
    again.load_state_dict(comp.state_dict())
    with tf.GradientTape() as tape:
        loss = loss_fn(vs, allg[R])
    got = [g.numpy() for g in hvd.DistributedGradientTape(tape, compression=again).gradient(loss, vs)]
    verify("stockauto.restored", spec, "sra", again.codec, got, allg)
    (restored,) = tf_graph._AUTOS[again].values()
    started = {red: sum(tf_graph._engine(again, hvd.global_process_set, red).steps.values())
               for red in ("allgather", "sra")}
    check(restored.choice.choice == choice and started == {r: int(r == choice) for r in started},
          "stockauto choice restored", f"{restored.choice.choice} {started}")


def run_stockv1(spec, reduction, case):
    allg = grads_of(case)
    comp = hvd_quant.StockCompression(codec_of(spec), reduction=reduction)
    vs = variables()
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=comp)
    gv = opt.compute_gradients(lambda: loss_fn(vs, allg[R]), var_list=vs)
    verify("stockv1", spec, reduction, comp.codec, [g.numpy() for g, _ in gv], allg)


def run_stockkeras(spec, reduction, case):
    allg = grads_of(case)
    comp = hvd_quant.StockCompression(codec_of(spec), reduction=reduction)
    vs = variables()
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=comp)
    gv = opt.compute_gradients(lambda: loss_fn(vs, allg[R]), vs)
    verify("stockkeras", spec, reduction, comp.codec, [g.numpy() for g, _ in gv], allg)


def run_tape(spec, reduction, case):
    allg = grads_of(case)
    vs = variables()
    codec = codec_of(spec)
    for step in range(2):
        with tf.GradientTape() as tape:
            loss = loss_fn(vs, allg[R])
        tape = hqt.DistributedGradientTape(tape, compression=codec, reduction=reduction,
                                           error_feedback=False)
        got = [g.numpy() for g in tape.gradient(loss, vs)]
        verify(f"tape.step{step}", spec, reduction, codec, got, allg)
    t = hqt.bytes_sent_per_step(tape)
    if not spec.startswith("fp16"):
        # w1, w2 compressed; b1 and small (96 elements) in fp32
        check(t["ratio"] > 1.9, f"bytes tape {spec} {reduction}", f"{t}")
        sm = hqt.step_metrics(tape)
        check(sm["sent"] == t["sent"] and sm["reduction"] == reduction and sm["buckets"]
              and all(b["reduction"] == reduction and b["precision"] == codec.spec()
                      for b in sm["buckets"])
              and sm["uncompressed"]["tensors"] >= 1 and 0 < sm["exchange_s"] < 60,
              f"step_metrics tape {spec} {reduction}",
              f"{sm['reduction']}, {len(sm['buckets'])} buckets, exchange {sm['exchange_s']} s")


def run_tapefn(spec, reduction, case):
    allg = grads_of(case)
    vs = variables()
    codec = codec_of(spec)
    mine = [tf.constant(g, tf.float32) for g in allg[R]]

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(v * g) for v, g in zip(vs, mine)])
        tape = hqt.DistributedGradientTape(tape, compression=codec, reduction=reduction,
                                           error_feedback=False)
        return tape.gradient(loss, vs)
    for s in range(2):
        verify(f"tapefn.step{s}", spec, reduction, codec, [g.numpy() for g in step()], allg)


def run_v1(spec, reduction, case):
    allg = grads_of(case)
    vs = variables()
    codec = codec_of(spec)
    opt = hqt.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                   compression=codec, reduction=reduction, error_feedback=False)
    gv = opt.compute_gradients(lambda: loss_fn(vs, allg[R]), var_list=vs)
    verify("v1", spec, reduction, codec, [g.numpy() for g, _ in gv], allg)


def run_keras(spec, reduction, case):
    allg = grads_of(case)
    vs = variables()
    codec = codec_of(spec)
    opt = hqk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), compression=codec,
                                   reduction=reduction, error_feedback=False)
    gv = opt.compute_gradients(lambda: loss_fn(vs, allg[R]), vs)
    verify("keras", spec, reduction, codec, [g.numpy() for g, _ in gv], allg)


def run_dtypes():
    """float16 and bfloat16 gradients through the hvd_quant tape and stock Horovod (bfloat16 is not
    an allreduce dtype in Horovod's TensorFlow ops: hvd_quant sends its uncompressed tensors as
    float32). Bound: the codec's, plus the final rounding to the gradient's dtype."""
    spec = "qsgd:bits=8,bucket_size=128,mode=deterministic"
    for dt, eps in ((tf.float16, 2.0 ** -11), (tf.bfloat16, 2.0 ** -8)):
        allg = grads_of(900 + len(RESULTS), dtype=np.float16 if dt == tf.float16 else np.float32)
        if dt == tf.bfloat16:     # inputs exactly representable in bfloat16
            allg = [[tf.cast(tf.cast(g, tf.bfloat16), tf.float64).numpy() for g in gs] for gs in allg]
        vs = [tf.Variable(tf.zeros(shape, dt), name=name) for name, shape in SHAPES]
        for label, make in (("tape", lambda t: hqt.DistributedGradientTape(
                                t, compression=hvd_quant.from_spec(spec))),
                            ("stocktape", lambda t: hvd.DistributedGradientTape(
                                t, compression=hvd_quant.from_spec(spec)))):
            with tf.GradientTape() as tape:
                loss = tf.add_n([tf.reduce_sum(tf.cast(v, tf.float32) * tf.constant(g, tf.float32))
                                 for v, g in zip(vs, allg[R])])
            tape = make(tape)
            got = tape.gradient(loss, vs)
            ok = all(g.dtype == dt for g in got)
            worst = 0.0
            for k, (name, _) in enumerate(SHAPES):
                xs = [allg[j][k].reshape(-1) for j in range(N)]
                exact = sum(xs) / N
                b = (bound(spec, "sra", xs, hvd_quant.from_spec(spec)) if compressed(name)
                     else sum(np.abs(x) for x in xs) * FP32_EPS * 4)
                b = b + np.abs(exact) * eps * 1.01 + 1e-30
                err = np.abs(tf.cast(got[k], tf.float64).numpy().reshape(-1) - exact)
                worst = max(worst, float((err / b).max()))
                ok &= bool((err <= b).all())
            RESULTS.extend(tf.cast(g, tf.float32).numpy() for g in got)
            check(ok, f"dtype {dt.name} {label}", f"max error/bound {worst:.3f}")


def main():
    t0 = time.time()
    only = sys.argv[1:] or ["core", "stock", "stocktape", "stockv1", "stockkeras", "tape", "tapefn",
                            "v1", "keras", "dtypes", "stockauto"]
    case = 0
    for spec in SPECS:
        for reduction in REDUCTIONS:
            for path in only:
                if path in ("dtypes", "stockauto"):
                    continue
                case += 1
                check.run(f"{path} {spec} {reduction}", globals()[f"run_{path}"], spec, reduction, case)
    if "dtypes" in only:
        check.run("dtypes", run_dtypes)
    if "stockauto" in only:
        check.run("stockauto", run_stockauto)
    check(same_on_all_ranks(RESULTS), "results bit-identical on every rank",
          f"{len(RESULTS)} tensors, {sum(np.asarray(r).nbytes for r in RESULTS)} bytes")
    print(f"TIME total {time.time() - t0:.1f}s", flush=True)
    check.finish()


if __name__ == "__main__":
    main()
