"""The exchange on real Horovod processes: tests/workers/torch_exchange.py (see its docstring for
every check and the error bounds), 2 and 4 ranks over Gloo, 3 and 8 ranks over MPI (more ranks than
cores: SRA's chunks and the traffic formula at the world sizes of the scaling runs)."""
import re

import pytest

from launch import run_horovod

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


def assert_all_ranks_passed(result, np_):
    """No failed check anywhere, and rank 0's summary shows every rank ran checks, none failed."""
    out = result.stdout
    fails = [line for line in out.splitlines() if "CHECK FAIL" in line]
    assert not fails, "\n".join(fails[:20]) + "\n--- stderr\n" + result.stderr[-4000:]
    m = re.search(r"SUMMARY ((?:rank\d+=\d+/\d+ ?)+) checks/failures over (\d+) ranks", out)
    assert m and int(m.group(2)) == np_, out[-4000:]
    counts = re.findall(r"rank(\d+)=(\d+)/(\d+)", m.group(1))
    assert len(counts) == np_ and all(int(n) > 0 and int(f) == 0 for _, n, f in counts), m.group(0)


@pytest.mark.parametrize("np_,controller", [
    pytest.param(2, "gloo", id="np2-gloo"),
    pytest.param(3, "mpi", id="np3-mpi", marks=pytest.mark.mpi),
    pytest.param(4, "gloo", id="np4-gloo"),
    pytest.param(8, "mpi", id="np8-mpi", marks=pytest.mark.mpi),
])
def test_exchange_on_real_collectives(np_, controller):
    result = run_horovod("torch_exchange.py", np=np_, controller=controller, timeout=400)
    assert_all_ranks_passed(result, np_)
