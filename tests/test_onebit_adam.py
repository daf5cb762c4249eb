"""``hvd_quant.torch.OneBitAdam`` and ``hvd_quant.tensorflow.OneBitAdam`` on real Horovod jobs:
tests/workers/torch_onebit_adam.py, torch_onebit_adam_elastic.py and tf_onebit_adam.py (their
docstrings list every check and derive the tolerances)."""
import re

import pytest

from launch import run_horovod
from test_exchange_multiproc import assert_all_ranks_passed

pytestmark = [pytest.mark.multiproc]


@pytest.mark.torch
@pytest.mark.parametrize("np_,controller,groups", [
    pytest.param(2, "gloo", ["adam", "frozen", "resume", "broadcast", "errors", "train"], id="np2-gloo"),
    pytest.param(3, "gloo", ["adam", "frozen", "resume"], id="np3-gloo"),
    pytest.param(2, "mpi", ["adam", "frozen", "resume", "broadcast"], id="np2-mpi", marks=pytest.mark.mpi),
])
def test_onebit_adam(np_, controller, groups):
    result = run_horovod("torch_onebit_adam.py", np=np_, controller=controller, args=groups, timeout=600)
    assert_all_ranks_passed(result, np_)
    if "train" in groups:
        assert re.search(r"TRAIN adam \S+ 1bit-adam \S+", result.stdout), result.stdout[-3000:]


ELASTIC_STEPS = 8


@pytest.mark.torch
def test_onebit_adam_elastic(tmp_path):
    """tests/workers/torch_onebit_adam_elastic.py (its docstring lists the checks) grown from 2 ranks
    to 3 and back, the variance frozen in the first phase."""
    from test_torch_elastic import _check_lines, _elastic_job
    result = _elastic_job(tmp_path, "onebit_adam", worker="torch_onebit_adam_elastic.py",
                          steps=ELASTIC_STEPS)
    out = result.stdout
    fails = [c for c in _check_lines(out) if c[0] == "FAIL"]
    assert not fails, "\n".join(" ".join(c) for c in fails) + "\n" + out[-4000:]
    for b in range(3 * ELASTIC_STEPS):
        want = 3 if ELASTIC_STEPS <= b < 2 * ELASTIC_STEPS else 2
        assert len(re.findall(r"CHECK ok identical\.b%d:" % b, out)) == want, (b, out[-3000:])
    assert len(re.findall(r"CHECK ok restore\.b\d+:", out)) == 2, out[-3000:]
    assert len(re.findall(r"CHECK ok variance\.b%d:" % ELASTIC_STEPS, out)) == 3, out[-3000:]
    assert len(re.findall(r"DONE rank \d/2 batch %d" % (3 * ELASTIC_STEPS), out)) == 2, out[-3000:]


@pytest.mark.tensorflow
def test_tf_onebit_adam():
    """tests/workers/tf_onebit_adam.py (its docstring lists every check and derives the bound)."""
    result = run_horovod("tf_onebit_adam.py", np=2, controller="gloo", timeout=600)
    assert_all_ranks_passed(result, 2)
    assert re.search(r"FIT onebit-adam loss \S+", result.stdout), result.stdout[-3000:]
