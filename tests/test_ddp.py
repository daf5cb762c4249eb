"""``hvd_quant.torch.ddp_comm_hook`` on real torch.distributed processes (Gloo, CPU) started by
torchrun: tests/workers/ddp_hook.py (its docstring lists the checks and derives the bounds), and
tests/workers/ddp_no_horovod.py (the hook in a process that cannot import Horovod)."""
import re
import sys

import pytest

from launch import run_command
from test_exchange_multiproc import assert_all_ranks_passed

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


def run_torchrun(script, np_, args=(), timeout=600):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(np_),
           f"tests/workers/{script}", *args]
    return run_command(cmd, timeout=timeout)


@pytest.mark.parametrize("np_,groups", [
    pytest.param(2, ["grads", "resume", "nosync", "unused", "auto", "bad"], id="np2"),
    pytest.param(3, ["grads", "resume", "nosync"], id="np3"),
])
def test_ddp_hook(np_, groups):
    result = run_torchrun("ddp_hook.py", np_, groups, timeout=900)
    assert_all_ranks_passed(result, np_)
    if "auto" in groups:        # decided once, printed once by rank 0
        assert len(re.findall(r"hvd_quant.ddp_comm_hook: reduction=auto chose", result.stdout)) == 1, \
            result.stdout[-3000:]


def test_ddp_hook_without_horovod():
    result = run_command([sys.executable, "tests/workers/ddp_no_horovod.py"], timeout=300)
    assert result.stdout.strip().splitlines()[-1] == "OK", result.stdout[-3000:] + result.stderr[-3000:]
