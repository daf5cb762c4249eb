"""Elastic training (``hvd.elastic.run`` + ``hvd.elastic.TensorFlowKerasState``) through hvd_quant's
TensorFlow frontend.

Launched by tests/test_tf_elastic.py as tests/workers/torch_elastic.py is (``horovodrun --gloo -np 2
--min-np 2 --max-np 3 --host-discovery-script``; rank 0 rewrites the hosts file): ``PHASE_STEPS``
steps at 2 ranks, at 3, then at 2 again, ``state.commit()`` after every step.

A Keras model trained by one ``tf.function`` step traced once, as in Horovod's own
``tensorflow2_mnist_elastic.py``, through ``hvd_quant.tensorflow.DistributedGradientTape``: argv[1]
``qsgd_sra`` (QSGD 4-bit SRA) or ``onebit_allgather`` (1-bit + error feedback over allgather). The traced step must follow the world size without
retracing (Horovod's own tape does: its ops read the size when they run).

Checks (``CHECK ok|FAIL``), on every rank: each step runs at its phase's world size; after every step
every model's weights are bit-identical on all ranks; the step's reduced gradient of the first
layer's kernel is within the 4-bit bound of an uncompressed ``hvd.allreduce`` (SRA: two
quantizations) at every size; the exchange's collectives have ``hvd.size()`` ranks.
"""
import faulthandler
import os
import sys
import time

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd
from horovod.common.exceptions import HorovodInternalError

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402
from elastic_schedule import SIZES, TOTAL, next_phase  # noqa: E402

import hvd_quant  # noqa: E402
import hvd_quant.tensorflow as hqt  # noqa: E402


faulthandler.dump_traceback_later(float(os.environ.get("HVDQ_TEST_HANG_S", "200")), exit=True)
hvd.init()
check = _checks.Checks(hvd)

MODE = sys.argv[1]
CODECS = {"qsgd_sra": (hvd_quant.QSGD(bits=4, mode="deterministic"), "sra"),
          "onebit_allgather": (hvd_quant.OneBit(), "allgather")}
if MODE not in CODECS:
    raise SystemExit(f"mode must be one of {sorted(CODECS)}, got {MODE!r}")
CODECS = {MODE: CODECS[MODE]}


def make_model(seed):
    init = tf.keras.initializers.GlorotUniform(seed=seed)
    return tf.keras.Sequential([tf.keras.Input((32,)),
                                tf.keras.layers.Dense(64, activation="relu", kernel_initializer=init),
                                tf.keras.layers.Dense(10, kernel_initializer=init)])


MODELS, OPTS, STEPS, REDUCERS = {}, {}, {}, {}
loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def make_step(model, opt, reducer):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        local = tape.gradient(loss, model.trainable_variables)
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        tape = hqt.DistributedGradientTape(tape, reducer=reducer)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return local[0], grads[0]
    return step


for i, (key, (codec, reduction)) in enumerate(CODECS.items()):
    m = MODELS[key] = make_model(100 + i)
    o = OPTS[key] = tf.keras.optimizers.SGD(0.01, momentum=0.9)
    r = REDUCERS[key] = hqt.GradientReducer(compression=codec, reduction=reduction)
    STEPS[key] = make_step(m, o, r)
    # Horovod's pattern: one local step creates the optimizer's slots before the state syncs them
    with tf.GradientTape() as tape:
        warm = loss_fn(tf.zeros([1], tf.int64), m(tf.zeros([1, 32]), training=True))
    o.apply_gradients(zip([g * 0 for g in tape.gradient(warm, m.trainable_variables)],
                          m.trainable_variables))

state = hvd.elastic.TensorFlowKerasState(MODELS[MODE], OPTS[MODE], batch=0, phase=0)


def same_everywhere(arrays, name):
    blob = np.concatenate([np.asarray(a, np.float32).reshape(-1) for a in arrays]).view(np.uint8)
    g = hvd.allgather(tf.constant(blob[None]), name=name).numpy()
    return all(np.array_equal(g[0], g[i]) for i in range(1, g.shape[0]))


def batch_for(b):
    rng = np.random.default_rng(1000 * b + hvd.rank())
    return (tf.constant(rng.normal(size=(8, 32)).astype(np.float32)),
            tf.constant(rng.integers(0, 10, 8)))


@hvd.elastic.run
def train(st):
    while st.batch < TOTAL:
        b, size = st.batch, hvd.size()
        next_phase(st, b, hvd.rank())
        check(size == SIZES[st.phase], f"size.b{b}", f"phase {st.phase} runs at {size} ranks")
        x, y = batch_for(b)
        for key, step in STEPS.items():
            try:
                local, got = step(x, y)
            except tf.errors.UnknownError as e:
                # Horovod's TF elastic wrapper swallows UnknownErrors it does not recognise
                check(False, f"step.{key}.b{b}", f"raised {e.message[-2000:]}")
                raise HorovodInternalError(e) if "Horovod" in e.message else RuntimeError(e.message)
            ref = hvd.allreduce(local, op=hvd.Average, name=f"ref.{key}.{b}.{size}").numpy()
            if key == "qsgd_sra":
                # deterministic 4-bit, SRA: each of the two quantizations errs by at most half a
                # level, M_j / 7 / 2, of the largest |g| summed over ranks; divided by N (Average)
                m = hvd.allgather(tf.reshape(tf.reduce_max(tf.abs(local)), [1]),
                                  name=f"max.{key}.{b}.{size}").numpy().astype(np.float64)
                bound = 2 * 0.5 * m.sum() / 7 / size
                err = float(np.abs(got.numpy() - ref).max())
                check(err <= bound * (1 + 1e-5) + 1e-7, f"bound.{key}.b{b}",
                      f"max error {err:.3g} <= {bound:.3g} at {size} ranks")
            else:
                cos = float(np.dot(got.numpy().ravel(), ref.ravel())
                            / (np.linalg.norm(got.numpy()) * np.linalg.norm(ref) + 1e-30))
                check(cos > 0.3, f"direction.{key}.b{b}", f"cosine {cos:.3f} at {size} ranks")
            check(same_everywhere(MODELS[key].get_weights(), f"chk.{key}.{b}.{size}"),
                  f"identical.{key}.b{b}", f"weights bit-identical on {size} ranks")
        engines = [r._engine for r in REDUCERS.values()]
        check(all(e.exchange.coll.size == size and e.exchange.coll.rank == hvd.rank()
                              for e in engines), f"bound.b{b}",
              f"{len(engines)} exchange(s) bound to {size} ranks")
        st.batch = b + 1
        st.commit()


t0 = time.monotonic()
train(state)
print(f"DONE rank {hvd.rank()}/{hvd.size()} batch {state.batch} in {time.monotonic() - t0:.1f}s", flush=True)
check.finish()
