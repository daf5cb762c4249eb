"""Worker: ranks configured differently get a clear error quickly, on every rank, with no hang.

Rank 0 uses one configuration, the other ranks another. Each case runs one gradient reduction and
expects it to raise, within seconds (tracing a ``tf.function`` is timed apart: on the shared 2-core
machine a first trace can take longer than the error), an error naming the problem ("configured differently",
:class:`hvd_quant.ConfigMismatchError`; inside a ``tf.function`` TensorFlow wraps it in a
``tf.errors`` exception carrying the same text). Prints ``MISMATCH r<rank> <case> <seconds> ok|FAIL``
per case (ok: it raised, and the message says "configured differently"), then a ``DETAIL`` line.

Cases: bits, bucket size, method (qsgd vs onebit), reduction (sra vs allgather), warm-up steps,
min_compress_numel (a different plan), model shape -- through ``hvd_quant.tensorflow`` (tape,
tf.function tape, Keras optimizer); bits and reduction through stock ``hvd.DistributedGradientTape``
(graph mode); bits and, last, reduction through stock eager ``hvd.allreduce``. In graph mode every
hvd_quant collective waits for the handshake, so nothing is left in flight after the error and the
next case runs in the same processes. The eager stock path submits its first collective with the
handshake (core ``Exchange.start``): with different reductions that collective never matches, so
that case runs last, and ``hvd.shutdown()`` fails that orphan at the end.
"""
import os
import sys
import time
import traceback

import tensorflow as tf

import horovod.tensorflow as hvd

hvd.init()

import hvd_quant  # noqa: E402
import hvd_quant.tensorflow as hqt  # noqa: E402
import hvd_quant.tensorflow.keras as hqk  # noqa: E402

R, N = hvd.rank(), hvd.size()
FIRST = R == 0
SETUP = {}      # case -> seconds spent tracing before the step that must fail


def variables(case, wide=64):
    return [tf.Variable(tf.random.normal((wide, 32), seed=1), name=f"{case}_w"),
            tf.Variable(tf.zeros((32,)), name=f"{case}_b")]


def loss_of(vs):
    return tf.add_n([tf.reduce_sum(v * v) for v in vs])


def hq_tape(case, **kw):
    vs = variables(case, kw.pop("wide", 64))
    with tf.GradientTape() as tape:
        loss = loss_of(vs)
    tape = hqt.DistributedGradientTape(tape, **kw)
    return [g.numpy() for g in tape.gradient(loss, vs)]


def hq_tape_fn(case, **kw):
    vs = variables(case)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_of(vs)
        tape = hqt.DistributedGradientTape(tape, **kw)
        return tape.gradient(loss, vs)
    t0 = time.perf_counter()
    fn = step.get_concrete_function()     # tracing is not the error path: timed apart
    SETUP[case] = time.perf_counter() - t0
    return [g.numpy() for g in fn()]


def hq_keras(case, **kw):
    vs = variables(case)
    opt = hqk.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), **kw)
    return [g.numpy() for g, _ in opt.compute_gradients(lambda: loss_of(vs), vs)]


def stock_tape(case, codec):
    vs = variables(case)
    with tf.GradientTape() as tape:
        loss = loss_of(vs)
    tape = hvd.DistributedGradientTape(tape, compression=codec)
    return [g.numpy() for g in tape.gradient(loss, vs)]


def stock_eager(case, codec):
    x = tf.random.normal((64, 32), seed=2)
    return hvd.allreduce(x, compression=codec, name=f"{case}.x").numpy()


Q4, Q8 = "qsgd:bits=4,bucket_size=128", "qsgd:bits=8,bucket_size=128"
CASES = [
    ("tape-bits", lambda c: hq_tape(c, compression=Q4 if FIRST else Q8)),
    ("tape-bucket-size", lambda c: hq_tape(c, compression=Q4 if FIRST else "qsgd:bits=4,bucket_size=256")),
    ("tape-method", lambda c: hq_tape(c, compression=Q4 if FIRST else "onebit:bucket_size=128")),
    ("tape-reduction", lambda c: hq_tape(c, compression=Q4, reduction="sra" if FIRST else "allgather")),
    ("tape-min-compress-numel", lambda c: hq_tape(c, compression=Q4,
                                                  min_compress_numel=1024 if FIRST else 4096)),
    ("tape-model-shape", lambda c: hq_tape(c, compression=Q4, wide=64 if FIRST else 96)),
    ("tapefn-bits", lambda c: hq_tape_fn(c, compression=Q4 if FIRST else Q8)),
    ("keras-warmup", lambda c: hq_keras(c, compression=Q4, warmup_steps=0 if FIRST else 10)),
    ("keras-method", lambda c: hq_keras(c, compression=Q4 if FIRST else "fp16")),
    ("stocktape-bits", lambda c: stock_tape(c, hvd_quant.from_spec(Q4 if FIRST else Q8))),
    ("stocktape-reduction", lambda c: stock_tape(c, hvd_quant.StockCompression(
        hvd_quant.from_spec(Q4), reduction="sra" if FIRST else "allgather"))),
    ("stock-eager-bits", lambda c: stock_eager(c, hvd_quant.from_spec(Q4 if FIRST else Q8))),
    ("stock-eager-reduction", lambda c: stock_eager(c, hvd_quant.StockCompression(
        hvd_quant.from_spec(Q4), reduction="sra" if FIRST else "allgather"))),
]


def warm_up():
    """TensorFlow's first trace of a tape inside a tf.function takes seconds here (measured ~9 s on
    the shared 2-core machine, matched or not); do it once so the timings below are the error path's."""
    v = tf.Variable(tf.ones((4, 4)))

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(v * v)
        return tape.gradient(loss, [v])
    step()


def main():
    warm_up()
    failures = 0
    for case, fn in CASES:
        t0 = time.perf_counter()
        try:
            fn(case)
            dt = time.perf_counter() - t0
            msg, ok = "no error raised", False
        except Exception as e:   # noqa: BLE001 - the error is what we test
            dt = time.perf_counter() - t0
            text = str(e)
            ok = "configured differently" in text
            lines = [ln for ln in text.splitlines() if "configured differently" in ln] or text.splitlines()[:1]
            msg = lines[0].strip() if lines else type(e).__name__
            if not ok or os.environ.get("HVDQ_DEBUG"):
                traceback.print_exc()
        failures += not ok
        setup = SETUP.get(case, 0.0)
        # Short lines: mpirun interleaves long lines of different ranks.
        print(f"MISMATCH r{R} {case} {dt - setup:.2f} {'ok' if ok else 'FAIL'}", flush=True)
        print(f"DETAIL r{R} {case}: traced in {setup:.2f}s; {msg[:240]}", flush=True)
    print(f"RESULT rank {R}/{N}: {len(CASES)} checks, {failures} failures", flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    hvd.shutdown()          # fails the collectives the last case left unmatched, and finalizes MPI
    # Every result is printed: skip the interpreter's teardown, where TensorFlow's threads once
    # aborted a rank ("exception not rethrown") after all of its checks had passed.
    os._exit(1 if failures else 0)


if __name__ == "__main__":
    main()
