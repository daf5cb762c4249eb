"""Thread safety of the codecs: equal codec objects (or one shared object) used on several threads at
once give the same bytes and values as each thread's calls alone.

What a run keeps between calls lives with its owner: direct seeded encodes count their calls per
codec object and thread, prepared kernel launches (which write a parameter buffer and scratch on
every call) are prepared per thread for direct calls and per plan inside the exchange. The device
path's check in the CUDA simulator: tests/test_codec_cuda_sim.py ("threads"); on a GPU, with two
CUDA streams: tests/test_codec_gpu.py.
"""
import threading

import numpy as np
import pytest

import hvd_quant
from hvd_quant import _codec

SPECS = ["qsgd:bits=4,bucket_size=512,seed=7", "qsgd:bits=3,bucket_size=512,seed=7", "onebit",
         "onebit:bucket_size=64", "sortquant:bits=4,split_bits=2,bucket_size=64,seed=5",
         "kmeans:bits=3,iters=2,bucket_size=128", "fp16"]
CALLS = 12


def _inputs(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(int(n)).astype(np.float32) for n in rng.integers(1, 3000, CALLS)]


def _run(codec, xs, name):
    """Each input encoded under ``name`` (seeded codecs count these calls), decoded, and added into an
    accumulator: the payload bytes and the decoded values, in call order."""
    out = []
    for x in xs:
        p = codec.encode(x, name=name)
        y = np.ones(x.size, np.float32)
        codec.decode_into(p, y, accumulate=True, name=name)
        out.append((bytes(p), y.tobytes()))
    return out


def _together(codecs_, inputs, name):
    """Run ``_run`` for every (codec, inputs) pair on its own thread, all at once."""
    results = [None] * len(codecs_)
    start = threading.Barrier(len(codecs_))

    def work(i):
        start.wait()
        results[i] = _run(codecs_[i], inputs[i], name)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(codecs_))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("shared", [False, True], ids=["equal-objects", "one-object"])
@pytest.mark.parametrize("spec", SPECS)
def test_threads_give_the_bytes_of_each_alone(spec, shared):
    """Two threads, each with its own equal codec (or both with one object), encode and decode other
    inputs at once: every payload and every decoded value is the one that thread's calls give alone
    (a seeded codec's k counts the calls of one thread)."""
    inputs = [_inputs(1), _inputs(2)]
    alone = [_run(hvd_quant.from_spec(spec), xs, "w") for xs in inputs]
    for _ in range(3):
        one = hvd_quant.from_spec(spec)
        pair = [one, one] if shared else [one, hvd_quant.from_spec(spec)]
        got = _together(pair, inputs, "w")
        for t in range(2):
            for k, (a, b) in enumerate(zip(got[t], alone[t])):
                assert a == b, f"thread {t}, call {k}: {'payload' if a[0] != b[0] else 'decoded values'} differ"


def test_prepared_launches_are_not_shared_between_threads():
    """Equal codecs on two threads get two prepared launches (each writes its own parameters)."""
    c1, c2 = hvd_quant.QSGD(bits=4, seed=1), hvd_quant.QSGD(bits=4, seed=1)
    got = []
    t = threading.Thread(target=lambda: got.append(_codec._thread_op(c1, "encode", False, 1000)))
    t.start()
    t.join()
    mine = _codec._thread_op(c2, "encode", False, 1000)
    assert got[0] is not None and mine is not got[0]
    assert _codec._thread_op(c1, "encode", False, 1000) is mine        # reused on one thread
