"""Both PyTorch entry points on real Horovod processes: tests/workers/torch_optim.py (its docstring
lists every check and derives the bounds; the training tolerance is in ``train_cases``)."""
import re

import pytest

from launch import run_horovod
from test_exchange_multiproc import assert_all_ranks_passed

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


@pytest.mark.parametrize("np_,controller,groups,env", [
    pytest.param(2, "gloo", ["grads", "options", "bytes", "resume", "train", "auto", "process-sets",
                             "payload-group"], None,
                 id="np2-gloo"),
    pytest.param(3, "mpi", ["grads", "options", "bytes", "resume", "auto", "process-sets", "payload-group"],
                 None, id="np3-mpi",
                 marks=pytest.mark.mpi),
    # several process sets at once, beside the global one: {0}, {1} at 2 ranks; {0,1} and {1,2}
    # overlapping at 3; {0,1}, {2,3} disjoint and {1,2,3} at 4; each rank count under both controllers
    pytest.param(3, "gloo", ["process-sets"], None, id="np3-gloo-sets"),
    # the same with the payload group (made on CUDA) as a Gloo group: sets whose first rank is not 0
    pytest.param(3, "gloo", ["process-sets"], {"HVDQ_TEST_PAYLOAD_GROUP": "gloo"},
                 id="np3-gloo-sets-group"),
    # the options (hook orders, SRA's second phase during backward, groups, predivide, passes, NaN)
    # with the payload groups carrying both reductions, as on CUDA
    pytest.param(2, "gloo", ["options"], {"HVDQ_TEST_PAYLOAD_GROUP": "gloo"}, id="np2-gloo-options-group"),
    pytest.param(4, "gloo", ["process-sets"], None, id="np4-gloo-sets"),
    pytest.param(2, "mpi", ["process-sets"], None, id="np2-mpi-sets", marks=pytest.mark.mpi),
    pytest.param(4, "mpi", ["process-sets"], None, id="np4-mpi-sets", marks=pytest.mark.mpi),
])
def test_optimizer_entry_points(np_, controller, groups, env):
    result = run_horovod("torch_optim.py", np=np_, controller=controller, args=groups, env=env,
                         timeout=600)
    assert_all_ranks_passed(result, np_)
    if "train" in groups:
        assert len(re.findall(r"TRAIN ", result.stdout)) >= 3


@pytest.mark.parametrize("np_,controller", [
    pytest.param(2, "gloo", id="np2-gloo"),
    pytest.param(3, "mpi", id="np3-mpi", marks=pytest.mark.mpi),
])
def test_ranks_configured_differently_fail_fast(np_, controller):
    result = run_horovod("torch_mismatch.py", np=np_, controller=controller, timeout=240)
    assert_all_ranks_passed(result, np_)
    lines = re.findall(r"MISMATCH (\S+) ([\d.]+) (\d+)/(\d+) (.*)", result.stdout)
    # 7 cases for hvd_quant's optimizer, 3 for stock Horovod's, the 3 again with the payload group
    assert len(lines) == 13, lines
    for case, seconds, ok, ranks, msg in lines:
        assert int(ok) == int(ranks) == np_, (case, ok, ranks, msg)
        assert float(seconds) < 10, (case, seconds)
        assert "configured differently" in msg, msg
