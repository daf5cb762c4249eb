"""Worker: ``hvd_quant.tensorflow.OneBitAdam`` on real Horovod processes (argv: the case groups).

Every rank draws its own batch from a generator seeded by (rank, step), so local gradients differ.

* ``adam``: during the warm-up the weights follow ``tf.keras.optimizers.Adam`` stepped on the gradients
  averaged by ``hvd.allreduce`` (same weight decay): bit for bit at 2 ranks (a + b is a + b in any
  fusion), eagerly and inside a ``tf.function``; every rank identical; fp32 bytes.
* ``frozen``: after the freeze, per bucket of the momentum reducer and step, error feedback gives
  N m' = sum_r m_r + sum_r (e_r - e'_r) + (E - E') (m_r: rank r's local momentum, e / e' its worker
  residual before / after, E / E' the server residuals of the chunks, tiling the bucket in rank
  order), up to float32 rounding, so per element |m' - mean_r m_r| <= (sum_r (|e_r| + |e'_r|) + |E|
  + |E'|) / N + 4 eps32 * (the magnitudes summed) (the derivation of tests/workers/torch_onebit_adam.py,
  "frozen"). Momentum and weights bit-identical on every rank, variance unchanged, bytes per step
  below fp32's / 8.
* ``resume``: ``tf.train.Checkpoint`` of model and optimizer after the freeze, read into new ones:
  the same weights as the uninterrupted run, bit for bit; without the residuals they differ.
* ``fit``: ``model.compile(optimizer=OneBitAdam)`` and ``fit`` (ranks start apart; Horovod's broadcast
  callback aligns them) through the freeze: weights identical on every rank, loss falls, compressed bytes.
* ``errors``: bad arguments and another variable list.
"""
import os
import sys

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402

import hvd_quant  # noqa: E402
import hvd_quant.tensorflow as hqt  # noqa: E402
from tf_common import FP32_EPS, Checks, same_on_all_ranks, uid  # noqa: E402

hvd.init()
R, N = hvd.rank(), hvd.size()
check = Checks()
CODEC = hvd_quant.OneBit(bucket_size=64)


def make_model(seed=0):
    tf.keras.utils.set_random_seed(seed)
    m = tf.keras.Sequential([tf.keras.layers.Dense(48, activation="tanh", input_shape=(16,), name="h1"),
                             tf.keras.layers.Dense(40, activation="tanh", name="h2"),
                             tf.keras.layers.Dense(4, name="out")])
    m(np.zeros((1, 16), np.float32))
    return m


def batch(step, rank=R):
    rs = np.random.RandomState(1000 * step + rank)
    return rs.randn(8, 16).astype(np.float32), rs.randn(8, 4).astype(np.float32)


def local_grads(model, step):
    x, y = batch(step)
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x) - y))
    return tape.gradient(loss, model.trainable_variables)


def onebit_adam(**kw):
    kw.setdefault("freeze_step", 3)
    kw.setdefault("bucket_bytes", 4096)     # several buckets, and chunks on every rank
    kw.setdefault("compression", CODEC)
    return hqt.OneBitAdam(**kw)


def adam_cases():
    lr, wd, steps = 1e-2, 0.05, 6
    for mode in ("eager", "tf.function"):
        model, ref = make_model(), make_model()
        opt = onebit_adam(learning_rate=lr, weight_decay=wd, freeze_step=10)
        ref_opt = tf.keras.optimizers.Adam(lr, weight_decay=wd, jit_compile=False)

        def applier(o, m):
            def apply(grads):
                o.apply_gradients(zip(grads, m.trainable_variables))
            return tf.function(apply) if mode == "tf.function" else apply
        apply, apply_ref = applier(opt, model), applier(ref_opt, ref)
        worst = 0.0
        for t in range(1, steps + 1):
            apply(local_grads(model, t))
            apply_ref([hvd.allreduce(g, op=hvd.Average, name=uid("ref")) for g in local_grads(ref, t)])
            worst = max(worst, max(float(np.max(np.abs(a.numpy() - b.numpy())))
                                   for a, b in zip(model.variables, ref.variables)))
        check(worst == 0.0, f"adam warm-up ({mode}) equals Keras Adam on the average", f"max |dw| {worst:.3g}")
        check(same_on_all_ranks([v.numpy() for v in model.variables]), f"adam warm-up ({mode}): identical")
        t = opt.bytes_per_step()
        check(t.ratio == 1.0 and t.sent_bytes > 0, f"adam warm-up ({mode}) sends fp32", f"{t}")


def gathered(vec):
    return hvd.allgather(tf.constant(np.asarray(vec, np.float64)[None]), name=uid("vec")).numpy()


def residuals(opt):
    """Per bucket of the momentum reducer: (this rank's worker residual, flat in bucket order; all ranks'
    server residuals concatenated in rank order), zeros before the first exchange."""
    red = opt.momentum_reducer
    state = red.state_dict()
    out = []
    for b in [b for trace in red._traces.values() for b in trace.plan.buckets]:
        w = state["residuals"]
        worker = (np.concatenate([np.asarray(w[n], np.float64).reshape(-1) for n in b.names])
                  if all(n in w for n in b.names) else np.zeros(b.numel))
        mine = [v for (h, r, size), v in state["server_residuals"].items() if h == b.header and size == N]
        parts = hvd.allgather_object(np.asarray(mine[0], np.float64) if mine else None, name=uid("srv"))
        server = (np.concatenate([p for p in parts if p is not None]) if any(p is not None for p in parts)
                  else np.zeros(b.numel))
        out.append((b, worker, server))
    return out


def frozen_cases():
    model, lr, wd, b1 = make_model(), 1e-2, 0.01, 0.9
    opt = onebit_adam(learning_rate=lr, weight_decay=wd)
    variables = model.trainable_variables
    apply = tf.function(lambda grads: opt.apply_gradients(zip(grads, variables)))
    for t in range(1, 4):
        apply(local_grads(model, t))
    check(opt.frozen, "frozen after freeze_step steps")
    by_name = {v.name: v for v in variables}
    v_frozen = [opt._velocities[opt._index_dict[opt._var_key(v)]].numpy().copy() for v in variables]
    for t in range(4, 9):
        grads = local_grads(model, t)
        # this rank's local momentum, as the optimizer forms it (the same float32 operations)
        local = {v.name: (opt._momentum(v) + (g - opt._momentum(v)) * (1 - b1)).numpy().astype(np.float64)
                 for g, v in zip(grads, variables)}
        before = residuals(opt) if t > 4 else None
        apply(grads)
        after = residuals(opt)
        if before is None:        # the first exchange: no residuals yet
            before = [(b, np.zeros(b.numel), np.zeros(b.numel)) for b, _, _ in after]
        for (b, e0, E0), (_, e1, E1) in zip(before, after):
            m_r = gathered(np.concatenate([local[n].reshape(-1) for n in b.names]))
            e_r, e1_r = gathered(e0), gathered(e1)
            m_new = np.concatenate([opt._momentum(by_name[n]).numpy().astype(np.float64).reshape(-1)
                                    for n in b.names])
            scale = (np.abs(m_r) + np.abs(e_r) + np.abs(e1_r)).sum(0) + np.abs(E0) + np.abs(E1) \
                + N * np.abs(m_new)
            lhs, rhs = N * m_new, m_r.sum(0) + (e_r - e1_r).sum(0) + (E0 - E1)
            err = np.abs(lhs - rhs)
            check(bool(np.all(err <= 4 * N * FP32_EPS * scale)),
                  f"frozen step {t} bucket {b.index}: N m' = sum m_r + worker and server residual change",
                  f"max err {err.max():.3g}")
            bound = ((np.abs(e_r) + np.abs(e1_r)).sum(0) + np.abs(E0) + np.abs(E1)
                     + 4 * N * FP32_EPS * scale) / N
            dev = np.abs(m_new - m_r.mean(0))
            check(bool(np.all(dev <= bound)), f"frozen step {t} bucket {b.index}: within the 1-bit bound",
                  f"max |m' - mean m_r| {dev.max():.3g}, max over its bound {(dev / bound).max():.3g}")
        check(same_on_all_ranks([opt._momentum(v).numpy() for v in variables] + [v.numpy() for v in variables]),
              f"frozen step {t}: momentum and weights identical on every rank")
    check(all(np.array_equal(a, opt._velocities[opt._index_dict[opt._var_key(v)]].numpy())
              for a, v in zip(v_frozen, variables)), "the variance stays frozen")
    tr = opt.bytes_per_step()
    check(0 < tr.sent_bytes < tr.fp32_bytes / 8, "frozen bytes per step far below fp32's",
          f"ratio {tr.ratio:.1f} ({tr.sent_bytes} B)")


def resume_cases():
    """tf.train.Checkpoint(model, optimizer) after the freeze, restored into a new model and optimizer:
    the next steps give the uninterrupted run's weights bit for bit (the residuals ride along as the
    optimizer's dependency ``hvd_quant``); restored without them, the weights differ."""
    import tempfile

    def make(seed):
        m = make_model(seed)
        o = onebit_adam(learning_rate=1e-2)
        return m, o, tf.function(lambda grads: o.apply_gradients(zip(grads, m.trainable_variables)))

    def run(m, apply, first, last):
        for t in range(first, last + 1):
            apply(local_grads(m, t))
        return [v.numpy() for v in m.variables]

    model, opt, apply = make(0)
    run(model, apply, 1, 5)
    path = tf.train.Checkpoint(model=model, optimizer=opt).write(
        os.path.join(tempfile.mkdtemp(), f"ck{R}"))
    straight = run(model, apply, 6, 8)
    m2, o2, apply2 = make(7)
    tf.train.Checkpoint(model=m2, optimizer=o2).read(path)   # slots restore when the optimizer builds
    again = run(m2, apply2, 6, 8)
    check(all(np.array_equal(a, b) for a, b in zip(straight, again)),
          "resume after the freeze equals the uninterrupted run, bit for bit")
    m3, o3, apply3 = make(7)
    tf.train.Checkpoint(model=m3, optimizer=o3).read(path)
    o3.momentum_reducer.reset_residuals()
    lost = run(m3, apply3, 6, 8)
    check(not all(np.array_equal(a, b) for a, b in zip(straight, lost)), "resume without residuals differs")


def fit_cases():
    rs = np.random.RandomState(5)
    w = rs.randn(16, 4).astype(np.float32)
    x = rs.randn(1024, 16).astype(np.float32)
    y = np.tanh(x @ w)
    model = make_model(100 + R)             # ranks start apart
    opt = hqt.OneBitAdam(3e-3, freeze_step=20)
    model.compile(optimizer=opt, loss="mse")
    start = float(model.evaluate(x, y, verbose=0))
    hist = model.fit(x[R::N], y[R::N], batch_size=32, epochs=5, verbose=0, shuffle=False,
                     callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    end = float(model.evaluate(x, y, verbose=0))
    check(int(opt.iterations.numpy()) == 5 * 16 and opt.frozen, "fit: ran through the freeze",
          f"{int(opt.iterations.numpy())} steps")
    check(same_on_all_ranks([v.numpy() for v in model.variables]), "fit: weights identical on every rank")
    check(end < start / 4, "fit: the loss falls", f"{start:.4f} -> {end:.4f}, {hist.history['loss'][-1]:.4f}")
    t = hqt.bytes_sent_per_step(opt)
    check(t["ratio"] > 8, "fit: compressed bytes after the freeze", str(t))
    print(f"FIT onebit-adam loss {end:.5f} start {start:.5f} ratio {t['ratio']:.1f}", flush=True)


def raises(what, fn, text):
    check.raises(what, fn, text=text)


def error_cases():
    for bad in (0, -1, 2.5, True, None):
        raises(f"freeze_step={bad!r}", lambda: onebit_adam(freeze_step=bad), "freeze_step")
    raises("a QSGD codec", lambda: onebit_adam(compression=hvd_quant.QSGD(bits=4)), "1-bit")
    raises("OneBit without error feedback", lambda: onebit_adam(compression=hvd_quant.OneBit(error_feedback=False)),
           "error feedback")
    raises("clipnorm", lambda: onebit_adam(clipnorm=1.0), "clipnorm")
    raises("amsgrad", lambda: onebit_adam(amsgrad=True), "amsgrad")
    model, other = make_model(), make_model(1)
    opt = onebit_adam()
    opt.apply_gradients(zip(local_grads(model, 1), model.trainable_variables))
    raises("another variable list", lambda: opt.apply_gradients(
        zip(local_grads(other, 1), other.trainable_variables)), "other variables")


def main():
    groups = sys.argv[1:] or ["adam", "frozen", "resume", "fit", "errors"]
    table = {"adam": adam_cases, "frozen": frozen_cases, "resume": resume_cases, "fit": fit_cases,
             "errors": error_cases}
    for g in groups:
        check.run(g, table[g])
    check.finish()


if __name__ == "__main__":
    main()
