"""Single-process tests of the TensorFlow frontend's pieces (no Horovod job): the NumPy ArrayOps
table, op names, codec resolution, the trackable state (serialize / restore through
``tf.train.Checkpoint``), and the frame-based names used by the stock path."""
import os

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("horovod.tensorflow")

import hvd_quant  # noqa: E402
from hvd_quant.tensorflow import OPS, GradientReducer, resolve_codec  # noqa: E402
from hvd_quant.tensorflow._backend import op_name, core_op, sendable_dtype  # noqa: E402
from hvd_quant.exchange import AVERAGE, SUM  # noqa: E402

pytestmark = pytest.mark.tensorflow


def test_ops_are_numpy_and_zero_copy_on_reads():
    t = tf.constant(np.arange(6, dtype=np.float32))
    flat = OPS.flatten([t, tf.constant([[7.0, 8.0]])])
    assert flat.dtype == np.float32 and flat.tolist() == [0, 1, 2, 3, 4, 5, 7, 8]
    view = OPS.slice(flat, 2, 5)
    view[:] = -1
    assert flat[2:5].tolist() == [-1, -1, -1]                      # slices are views
    ro = np.asarray(t)
    assert not ro.flags.writeable                                  # TF's own buffer, read-only
    out = OPS.add_(ro, np.ones(6, np.float32))                     # never written in place
    assert out is not ro and np.asarray(t).tolist() == list(range(6))
    buf = np.zeros(3, np.float32)
    buf[:] = [1, 2, 3]
    assert OPS.scale_(buf, np.array([0.5], np.float32)).tolist() == [0.5, 1, 1.5]
    assert OPS.empty_bytes(7, None).size == 7 and OPS.empty_bytes(7, None).dtype == np.uint8
    assert OPS.to_bytes(OPS.from_bytes(b"abc")) == b"abc"


def test_op_names_survive_horovod_name_scopes():
    assert op_name("dense/kernel:0") == "dense_kernel_0"
    assert op_name("_x") == "h_x"
    assert "/" not in op_name("a/b/c")


def test_resolve_codec_and_ops():
    import horovod.tensorflow as hvd
    assert resolve_codec(None).spec() == "none"
    assert resolve_codec("qsgd:bits=4,bucket_size=512").bits == 4
    c = hvd_quant.OneBit()
    assert resolve_codec(c) is c and resolve_codec(hvd_quant.StockCompression(c)) is c
    assert resolve_codec(hvd.Compression.fp16).spec() == "fp16"
    assert core_op(hvd.Average) == AVERAGE and core_op(hvd.Sum) == SUM
    with pytest.raises(ValueError, match="Adasum"):
        core_op(hvd.Adasum)
    assert sendable_dtype(tf.bfloat16) == tf.float32 and sendable_dtype(tf.float16) == tf.float16


def test_state_roundtrip_through_checkpoint(tmp_path):
    r = GradientReducer(compression=hvd_quant.OneBit(bucket_size=64))
    r.load_state_dict({"step": 5, "residuals": {"dense/kernel:0": np.arange(12, dtype=np.float32).reshape(3, 4)},
                       "server_residuals": {("dense/kernel:0", 0, 2): np.ones(8, np.float32)},
                       "exchange_steps": {"dense/kernel:0": 5}})
    path = tf.train.Checkpoint(hvd_quant=r).save(os.path.join(tmp_path, "ck"))
    r2 = GradientReducer(compression=hvd_quant.OneBit(bucket_size=64))
    tf.train.Checkpoint(hvd_quant=r2).restore(path).assert_consumed()
    st = r2.state_dict()
    assert st["step"] == 5 and int(r2.step.numpy()) == 5
    assert np.array_equal(st["residuals"]["dense/kernel:0"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert np.array_equal(st["server_residuals"][("dense/kernel:0", 0, 2)], np.ones(8, np.float32))
    assert st["exchange_steps"] == {"dense/kernel:0": 5}


def test_tapes_with_equal_codecs_find_one_reducer():
    """``DistributedGradientTape(tape, compression=hvd_quant.QSGD(bits=4))`` written inline makes a new
    codec object each step; equal codecs (and equal spec strings) must key the same reducer, or every
    step would start afresh (warm-up never ending, residuals lost, a new trace per step)."""
    import horovod.tensorflow as hvd
    from hvd_quant.tensorflow import wrappers

    def key(compression):
        args = dict(compression=compression, op=hvd.Average, reduction="sra", bucket_bytes=1 << 20,
                    min_compress_numel=1024, warmup_steps=0, error_feedback=None, compress_1d=False,
                    device_exchange=False, groups=None, num_groups=0, process_set=hvd.global_process_set)
        args.update({k: None for k in wrappers._REDUCER_ARGS if k not in args})
        return wrappers._tape_key(wrappers._reducer_args(args))

    a, b, c = hvd_quant.QSGD(bits=4, seed=1), hvd_quant.QSGD(bits=4, seed=1), hvd_quant.QSGD(bits=8, seed=1)
    assert a is not b and key(a) == key(b) != key(c)        # all alive: no id reused
    assert key("qsgd:bits=4") == key("qsgd:bits=4") != key("qsgd:bits=8")


def test_keras3_optimizers_refused_keras2_taken(monkeypatch):
    """Horovod 0.28.1's Keras wrapper leaves a Keras 3 optimizer's gradients unreduced (each rank trains
    alone; seen with TF 2.19): both optimizer wrappers refuse one, naming the way out. With TensorFlow
    2.15 (Keras 2) the installed ``keras`` is given a major version of 3 to stand in for Keras 3."""
    import keras
    import hvd_quant.tensorflow.keras as hqk
    from hvd_quant.tensorflow import DistributedOptimizer

    if int(keras.__version__.split(".")[0]) < 3:
        keras2 = keras.optimizers.SGD(0.1)
        assert type(hqk.DistributedOptimizer(keras2, compression="qsgd")).__name__ == "SGD"
        assert type(tf.keras.optimizers.SGD(0.1)).__module__.partition(".")[0] == "keras"
        monkeypatch.setattr(keras, "__version__", "3.0.0")
    else:                        # TensorFlow >= 2.16 with TF_USE_LEGACY_KERAS=1: tf.keras is tf_keras
        legacy = tf.keras.optimizers.SGD(0.1)
        assert type(hqk.DistributedOptimizer(legacy, compression="qsgd")).__name__ == "SGD"
    for wrap in (hqk.DistributedOptimizer, DistributedOptimizer):
        with pytest.raises(TypeError, match="Keras 3 optimizer.*TF_USE_LEGACY_KERAS=1"):
            wrap(keras.optimizers.SGD(0.1), compression="qsgd")


def test_reducer_refuses_bad_arguments():
    with pytest.raises(ValueError, match="reduction"):
        GradientReducer(compression="qsgd", reduction="ring")
    with pytest.raises(ValueError, match="predivide"):
        import horovod.tensorflow as hvd
        GradientReducer(compression="qsgd", op=hvd.Sum, gradient_predivide_factor=2.0)


def test_horovod_context_finds_variable_names():
    """The stock path reads the gradient's variable from Horovod's frames (autograph copies included):
    traced here in one process with a spy compressor; Horovod's cond skips the allreduce at size 1,
    but both branches are traced."""
    import horovod.tensorflow as hvd
    from hvd_quant.tensorflow._graph import horovod_context
    hvd.init()
    seen = []

    class Spy:
        @staticmethod
        def compress(t):
            c = horovod_context(t)
            seen.append((c.variable, c.name))
            return t, None

        @staticmethod
        def decompress(t, ctx):
            return t
    vs = [tf.Variable(tf.ones((4, 4)), name="unit_a"), tf.Variable(tf.ones((3,)), name="unit_b")]
    with tf.GradientTape() as tape:
        loss = tf.add_n([tf.reduce_sum(v * v) for v in vs])
    hvd.DistributedGradientTape(tape, compression=Spy).gradient(loss, vs)
    assert [v for v, _ in seen] == ["unit_a:0", "unit_b:0"], seen


def test_tape_takes_keras3_variables():
    """Horovod 0.28.1's tape keys its sources by ``.ref()``, which Keras 3's variables lack (an
    AttributeError with TF 2.19 and Keras 3); hvd_quant's tape hands Horovod the ``tf.Variable`` each
    holds, for ``gradient`` and ``register_local_source``. With Keras 2 (TF 2.15) a stand-in plays the
    Keras 3 variable: an object without ``ref`` whose ``value`` is a tf.Variable. One process: the
    gradient must be the local one, 2 * v."""
    import horovod.tensorflow as hvd
    import keras
    import hvd_quant.tensorflow as hqt
    hvd.init()
    if int(keras.__version__.split(".")[0]) >= 3:
        k3 = keras.Variable(np.arange(2048, dtype=np.float32), name="k3")
        assert not hasattr(k3, "ref")
    else:
        class Keras3Variable:
            value = tf.Variable(np.arange(2048, dtype=np.float32), name="k3")
        k3 = Keras3Variable()
    local = tf.Variable(np.ones(3, np.float32), name="k3_local")

    def held(v):
        return v if isinstance(v, tf.Variable) else v.value
    for sources in ([k3], [k3, local]):
        with tf.GradientTape() as tape:
            loss = tf.add_n([tf.reduce_sum(tf.square(held(v))) for v in sources])
        tape = hqt.DistributedGradientTape(tape, compression=hvd_quant.QSGD(bits=8))
        if len(sources) == 2:
            tape.register_local_source(local)
        grads = tape.gradient(loss, sources)
        for v, g in zip(sources, grads):
            np.testing.assert_array_equal(g.numpy(), 2 * held(v).numpy())
