"""``hvd_quant.torch.OneBitAdam`` on real Horovod jobs: tests/workers/torch_onebit_adam.py (its
docstring lists every check and derives the tolerances)."""
import re

import pytest

from launch import run_horovod
from test_exchange_multiproc import assert_all_ranks_passed

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


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
