"""Horovod's usage patterns with both PyTorch entry points, on real Horovod processes:
tests/workers/torch_patterns.py (resume with broadcast_optimizer_state / TorchState.sync, sparse
gradients, uneven data, hvd.join() with uneven steps, clipping, parameters without gradients,
requires_grad, groups, op, predivide, two optimizers sharing a codec) and tests/workers/torch_rank_death.py (a rank SIGKILLed mid-step)."""
import re
import time

import pytest

from launch import run_horovod
from test_exchange_multiproc import assert_all_ranks_passed

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


@pytest.mark.parametrize("controller,np_,groups", [
    pytest.param("gloo", 2, ["resume", "sparse", "uneven", "join", "patterns"], id="np2-gloo"),
    pytest.param("gloo", 3, ["join"], id="np3-gloo"),
    pytest.param("mpi", 2, ["resume", "sparse", "uneven", "join"], id="np2-mpi", marks=pytest.mark.mpi),
])
def test_optimizer_patterns(controller, np_, groups):
    # the worker dumps its stacks and exits after HVDQ_TEST_HANG_S, before the launcher's timeout
    result = run_horovod("torch_patterns.py", np=np_, controller=controller, args=groups, timeout=420,
                         env={"HVDQ_TEST_HANG_S": 360})
    assert_all_ranks_passed(result, np_)
    for g in groups:
        assert re.search(rf"TIME {g} ", result.stdout), g


@pytest.mark.parametrize("where", ["hook", "advance"])
def test_rank_killed_mid_step_ends_the_job(where, tmp_path):
    """The last of 3 ranks SIGKILLs itself during a step (in a gradient hook, or between SRA's two
    phases). The job must end with a failure within 120 s, and every survivor must get Horovod's own
    error (they ignore the launcher's SIGTERM, which would otherwise end them first; the launcher
    kills them 5 s later)."""
    np_ = 3
    t0 = time.monotonic()
    result = run_horovod("torch_rank_death.py", np=np_, controller="gloo", args=[where], timeout=150,
                         check=False, env={"HVDQ_TEST_DEATH_FILE": tmp_path / "death",
                                           "HVDQ_IGNORE_TERM": "1", "HVDQ_TEST_HANG_S": 140})
    took = time.monotonic() - t0
    out = result.stdout
    assert result.returncode != 0, out[-3000:]
    assert took < 120, took
    assert f"VICTIM {np_ - 1} kills itself ({where})" in out, out[-3000:] + result.stderr[-3000:]
    survivors = re.findall(r"SURVIVOR (\d+) (\w+) ([\d.]+)", out)
    assert sorted(int(r) for r, _, _ in survivors) == list(range(np_ - 1)), \
        out[-3000:] + result.stderr[-3000:]
    for rank, kind, seconds in survivors:
        assert kind == "HorovodInternalError" and float(seconds) < 60, (rank, kind, seconds)
    assert "NO-ERROR" not in out
