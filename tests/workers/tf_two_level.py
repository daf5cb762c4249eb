"""Worker: TensorFlow's ``GradientReducer(reduction="two_level")`` on emulated nodes (2 hosts x 2
ranks; tests/test_two_level.py), eagerly and inside a ``tf.function``.

Bound against the exact float64 average: each node's fp32 sum is quantized once (allgather between
two nodes); deterministic QSGD errs at most unit/2 = max|node sum| / (2s) per element, and a node
sum's max is at most the sum of its ranks' max |x_j|, so the average errs at most
sum_j max|x_j| / (2 s N), plus float32 summation slack. Every rank gets the same bytes.
"""
import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

import hvd_quant
import hvd_quant.tensorflow as hqt

from tf_common import FP32_EPS, Checks, same_on_all_ranks

hvd.init()
R, N = hvd.rank(), hvd.size()
check = Checks()


def case(label, fn):
    codec = hvd_quant.QSGD(bits=4, bucket_size=512, mode="deterministic")
    reducer = hqt.GradientReducer(compression=codec, reduction="two_level", bucket_bytes=1 << 14)
    shapes = [(64, 70), (33, 129), (5000,)]
    for step in range(2):
        xs = [[np.random.default_rng(1000 * r + 10 * step + i).standard_normal(s).astype(np.float32)
               for i, s in enumerate(shapes)] for r in range(N)]
        grads = [tf.constant(x) for x in xs[R]]
        out = fn(reducer, grads)
        s = (1 << (codec.bits - 1)) - 1
        ok = True
        for i in range(len(shapes)):
            exact = sum(x[i].astype(np.float64) for x in xs) / N
            m = sum(float(np.abs(x[i]).max()) for x in xs)
            if len(shapes[i]) > 1:          # compressed; the 1-D one is summed in fp32 by Horovod
                b = m / (2 * s * N) + 16 * FP32_EPS * m
            else:
                b = 4 * FP32_EPS * m
            ok &= bool(np.all(np.abs(out[i].numpy() - exact) <= b))
        check(ok, f"{label} step {step} within bound")
        check(same_on_all_ranks([o.numpy() for o in out]), f"{label} step {step} identical on every rank")


case("eager", lambda reducer, grads: reducer(grads))
case("tf.function", lambda reducer, grads: tf.function(lambda g: reducer(g), autograph=False)(grads))
check.finish()
