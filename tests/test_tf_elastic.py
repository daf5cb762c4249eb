"""Horovod elastic training through hvd_quant's TensorFlow frontend, on real processes:
tests/workers/tf_elastic.py under ``horovodrun --gloo --min-np 2 --max-np 3 --host-discovery-script``,
growing from 2 ranks to 3 and shrinking back to 2, with ``hvd.elastic.TensorFlowState`` and
``hvd_quant.tensorflow.DistributedGradientTape`` inside a ``tf.function`` step traced once (QSGD 4-bit
SRA; 1-bit with error feedback over allgather). Horovod's own tape with ``compression=<codec>`` inside
``tf.function`` refuses elastic mode clearly, on every rank."""
import re

import pytest

from launch import run_horovod
from test_torch_elastic import _check_lines, _elastic_job

pytestmark = [pytest.mark.multiproc, pytest.mark.tensorflow]

STEPS = 6       # per phase


@pytest.mark.parametrize("mode", ["qsgd_sra", "onebit_allgather"])
def test_tf_elastic_grow_and_shrink(mode, tmp_path):
    result = _elastic_job(tmp_path, mode, worker="tf_elastic.py", steps=STEPS)
    out = result.stdout
    fails = [c for c in _check_lines(out) if c[0] == "FAIL"]
    assert not fails, "\n".join(" ".join(c) for c in fails) + "\n" + out[-4000:]
    counts = {}
    whats = ("size", f"identical.{mode}", "bound.qsgd_sra" if mode == "qsgd_sra"
             else "direction.onebit_allgather")
    for name in re.findall(r"CHECK ok (%s)\.b(\d+):" % "|".join(map(re.escape, whats)), out):
        counts[name] = counts.get(name, 0) + 1
    for b in range(3 * STEPS):
        want = 3 if STEPS <= b < 2 * STEPS else 2
        for what in whats:
            assert counts.get((what, str(b))) == want, (what, b, counts.get((what, str(b))), out[-3000:])
    assert len(re.findall(r"DONE rank \d/2 batch %d" % (3 * STEPS), out)) == 2, out[-3000:]


STOCK_ELASTIC = """
import tensorflow as tf
import horovod.tensorflow as hvd
import hvd_quant
hvd.init()
v = tf.Variable(tf.ones([64, 32]))

@tf.function
def step():
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(v * v)
    tape = hvd.DistributedGradientTape(tape, compression=hvd_quant.QSGD(bits=4))
    return tape.gradient(loss, [v])

try:
    step()
    print("NO-ERROR", flush=True)
except ValueError as e:
    print(f"REFUSED {hvd.rank()}: {e}", flush=True)
"""


def test_tf_stock_path_refuses_elastic(tmp_path):
    """The stock TensorFlow path inside tf.function is not elastic-safe: it says so on every rank
    (under HOROVOD_ELASTIC=1) instead of hanging at the first change."""
    script = tmp_path / "stock_elastic.py"
    script.write_text(STOCK_ELASTIC)
    result = run_horovod(script, np=2, controller="gloo", timeout=180, env={"HOROVOD_ELASTIC": "1"})
    out = result.stdout
    refused = re.findall(r"^\[(\d)\]<stdout>:REFUSED \1:", out, re.M)      # TF wraps the message
    says = re.findall(r"^\[(\d)\]<stdout>:.*ValueError: hvd_quant: .*does not support elastic Horovod",
                      out, re.M)
    assert sorted(refused) == sorted(says) == ["0", "1"] and "NO-ERROR" not in out, out[-3000:]
