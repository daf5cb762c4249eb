"""``reduction="two_level"`` on real Horovod jobs of 2 emulated nodes x 2 ranks, Gloo and MPI
(tests/workers/torch_two_level.py: its docstring lists the checks), and the node layout's rules."""
import pytest

from launch import run_horovod
from test_exchange_multiproc import assert_all_ranks_passed

from hvd_quant.frontend import node_ranks

DYNAMIC = {"HOROVOD_DYNAMIC_PROCESS_SETS": "1", "HVDQ_TEST_NODES": "2"}


@pytest.mark.multiproc
@pytest.mark.torch
@pytest.mark.parametrize("controller,groups", [
    pytest.param("gloo", ["topology", "grads"], id="gloo-grads"),
    pytest.param("gloo", ["resume", "join", "bytes", "auto"], id="gloo-resume-join-auto"),
    pytest.param("mpi", ["topology", "grads", "resume"], id="mpi", marks=pytest.mark.mpi),
])
def test_two_level_on_two_nodes(controller, groups):
    result = run_horovod("torch_two_level.py", np=4, nodes=2, controller=controller, args=groups,
                         env=DYNAMIC, timeout=600)
    assert_all_ranks_passed(result, 4)
    if "auto" in groups:        # rank 0 prints each optimizer's choice among the four ways, once
        chose = [line for line in result.stdout.splitlines() if "reduction=auto chose" in line]
        assert len(chose) == 2 and all("two_level" in line for line in chose), chose


@pytest.mark.multiproc
@pytest.mark.torch
def test_two_level_on_one_node():
    result = run_horovod("torch_two_level.py", np=2, args=["one-node"], env=DYNAMIC, timeout=300)
    assert_all_ranks_passed(result, 2)
    assert "reduction='two_level' on 1 node(s) of 2 rank(s): an fp32 allreduce" in result.stdout


@pytest.mark.multiproc
@pytest.mark.tensorflow
def test_two_level_tensorflow():
    result = run_horovod("tf_two_level.py", np=4, nodes=2, env=DYNAMIC, timeout=600)
    assert_all_ranks_passed(result, 4)


def test_node_ranks():
    # (cross rank, local rank, local size) of each global rank
    assert node_ranks([(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]) == [[0, 1], [2, 3]]
    assert node_ranks([(0, 0, 2), (1, 0, 2), (0, 1, 2), (1, 1, 2)]) == [[0, 2], [1, 3]]
    with pytest.raises(ValueError, match="same number of ranks"):
        node_ranks([(0, 0, 2), (0, 1, 2), (1, 0, 1)])
