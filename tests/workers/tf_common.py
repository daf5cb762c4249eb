"""Helpers shared by the TensorFlow workers: a check collector, cross-rank comparisons, bounds.

Every worker prints one ``CHECK ok|FAIL <name>: <detail>`` line per check and ends with
``RESULT rank <r>/<n>: <checks> checks, <failures> failures``; it exits 1 when anything failed, so the
pytest side sees both the exit status and which check failed on which rank.
"""
import os
import sys

import numpy as np
import tensorflow as tf

import horovod.tensorflow as hvd

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import checks as _checks  # noqa: E402

FP32_EPS = 2.0 ** -23


class Checks(_checks.Checks):
    def __init__(self):
        super().__init__(hvd)


_counter = [0]


def uid(prefix):
    _counter[0] += 1
    return f"{prefix}.{_counter[0]}"


def raw_bytes(arrays):
    """The bytes of a list of tensors/arrays, concatenated (uint8 NumPy)."""
    return np.concatenate([np.ascontiguousarray(np.asarray(a)).reshape(-1).view(np.uint8)
                           for a in arrays]) if arrays else np.empty(0, np.uint8)


def same_on_all_ranks(arrays):
    """True when the given tensors hold the same bytes on every rank (NaN payloads included)."""
    raw = raw_bytes(arrays)
    gathered = hvd.allgather(tf.constant(raw[None]), name=uid("chk.same")).numpy()
    return all(np.array_equal(gathered[0], gathered[i]) for i in range(1, gathered.shape[0]))


def weights_identical(variables):
    return same_on_all_ranks([v.numpy() for v in variables])


def all_ranks_true(flag):
    v = tf.constant([1 if flag else 0], dtype=tf.int32)
    return int(hvd.allreduce(v, op=hvd.Min, name=uid("chk.all")).numpy()[0]) == 1


def bound(spec, reduction, xs, codec):
    """Per-element |error| bound of the exchange's **average** against the exact float64 average.

    xs: every rank's input (float64 arrays, rank order), as the flat buffer the exchange sees, which
    in these tests starts on a bucket boundary. Derivation:

    - QSGD (max-abs scale per bucket of d elements, s = 2^(bits-1) - 1 levels per sign): an element
      moves to one of the two neighbouring levels, unit = m/s apart (m: the bucket's max |x|): error
      < unit (stochastic), <= unit/2 (deterministic). allgather quantizes each rank's data once:
      sum_j m_j / s; SRA also requantizes the reduced chunk, whose decoded values are bounded by
      sum_j m_j (each rank's decoded values are within +-m_j): twice that.
    - OneBit (two means per bucket): every value is replaced by the mean of the values of its sign,
      which lies between 0 and m: error <= m per quantization, so sum_j m_j, doubled for SRA.
    - SortQuant: a group's unit, (max - min) / L, is at most its bucket's range over L, and the
      reduced chunk's range is at most the sum of the ranks' ranges: sum_j range_j / L per
      quantization (half of it deterministic), doubled for SRA.
    - KMeans: a value and its centroid (a mean of its bucket's values) both lie in the bucket's
      range: sum_j range_j per quantization, doubled for SRA.
    - fp16: relative 2^-11 per rounding, once for allgather, twice for SRA.
    Divided by N for the average, plus float32 summation slack.
    """
    n = xs[0].size
    N = len(xs)
    q = 1 if reduction == "allgather" else 2
    if spec.startswith(("qsgd", "onebit", "sortquant", "kmeans")):
        d = codec.bucket_size or max(n, 1)
        nb = -(-n // d)
        m = np.zeros(nb)
        rng = np.zeros(nb)
        for x in xs:
            pad = np.zeros(nb * d)
            pad[:n] = np.abs(x)
            m += pad.reshape(nb, d).max(1)
            lo, hi = np.full(nb * d, np.inf), np.full(nb * d, -np.inf)
            lo[:n] = hi[:n] = x
            rng += hi.reshape(nb, d).max(1) - lo.reshape(nb, d).min(1)
        if spec.startswith("qsgd"):
            s = (1 << (codec.bits - 1)) - 1
            per_q = m / s * (0.5 if codec.mode == "deterministic" else 1.0)
        elif spec.startswith("sortquant"):
            L = (1 << (codec.bits - codec.split_bits)) - 1
            per_q = rng / L * (0.5 if codec.mode == "deterministic" else 1.0)
        elif spec.startswith("kmeans"):
            per_q = rng
        else:
            per_q = m
        b = np.repeat(per_q * q, d)[:n] + 16 * FP32_EPS * np.repeat(m, d)[:n] * N
        return b / N
    absum = sum(np.abs(x) for x in xs)
    if spec.startswith("fp16"):
        return (absum * (2.0 ** -11) * q * 1.01 + 16 * FP32_EPS * absum * N) / N
    return (absum * FP32_EPS * 4 * N) / N
