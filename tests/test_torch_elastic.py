"""Horovod elastic training through hvd_quant, on real processes: tests/workers/torch_elastic.py under
``horovodrun --gloo --min-np 2 --max-np 3 --host-discovery-script``, growing from 2 ranks to 3 and
shrinking back to 2, with ``hvd_quant.torch.DistributedOptimizer`` (QSGD SRA, 1-bit SRA with error
feedback, ``reduction="auto"``) and stock Horovod's optimizer (``compression=QSGD``,
``StockCompression(..., reduction="sra")``) side by side in one job.

What the residuals do across a change (checked by the worker; docs/EXCHANGE.md, "Elastic"): Horovod
restores nothing on ``HostsUpdatedInterrupt`` and ``TorchState.sync()`` broadcasts only the wrapped
optimizer's state, so surviving ranks keep their worker and server residuals unchanged and a joining
worker starts with none; server residuals are keyed by ``(bucket, rank, size)``, so at a new size each
rank starts a new one (a rank back at an earlier size with the same rank continues the one it left).
"""
import re
import stat
import sys
import time

import pytest

from launch import horovodrun, run_command

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]

STEPS = 20      # per phase: reduction="auto" decides after 3 + 15 steps


def _elastic_job(tmp_path, mode, worker="torch_elastic.py", steps=STEPS, group=None):
    hosts = tmp_path / "hosts"
    hosts.write_text("localhost:2\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat '{hosts}'\n")
    discover.chmod(discover.stat().st_mode | stat.S_IXUSR)
    cmd = [*horovodrun(), "--gloo", "-np", "2", "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(discover), "--elastic-timeout", "60",
           "--start-timeout", "60", "--network-interface", "lo",
           sys.executable, f"tests/workers/{worker}", mode]
    t0 = time.monotonic()
    env = {"HVDQ_ELASTIC_HOSTS": hosts, "HVDQ_ELASTIC_STEPS": steps}
    if group:
        env["HVDQ_TEST_PAYLOAD_GROUP"] = group
    # a hang guard: three worlds' starts and the torch job's five models take minutes on busy cores
    result = run_command(cmd, timeout=480, env=env)
    print(f"{mode}: {time.monotonic() - t0:.1f}s")
    return result


def _check_lines(out):
    return re.findall(r"CHECK (ok|FAIL) (\S+): ?(.*)", out)


# Both frontends' models train side by side in one job (the world changes are what cost time); the
# job runs twice: payloads through Horovod's collectives, and through Gloo payload groups (the
# groups made on CUDA), where a new world's ranks must agree on which steps the groups carry.
@pytest.mark.parametrize("group", [None, "gloo"], ids=["horovod", "payload-group"])
def test_elastic_grow_and_shrink(group, tmp_path):
    check_elastic_output(_elastic_job(tmp_path, "hvdq,stock", group=group).stdout)


def check_elastic_output(out):
    fails = [c for c in _check_lines(out) if c[0] == "FAIL"]
    assert not fails, "\n".join(" ".join(c) for c in fails) + "\n" + out[-4000:]
    # every step of every phase ran at its size, on every rank of that phase
    steps = {}
    for name in re.findall(r"CHECK ok size\.b(\d+):", out):
        steps[int(name)] = steps.get(int(name), 0) + 1
    for b in range(3 * STEPS):
        want = 3 if STEPS <= b < 2 * STEPS else 2
        assert steps.get(b) == want, (b, steps.get(b), out[-3000:])
    # every model's parameters bit-identical on every rank after every step
    for k in ("qsgd_sra", "onebit_sra", "qsgd_auto", "stock_auto", "stock_sra"):
        assert len(re.findall(r"CHECK ok identical\.%s\.b\d+:" % k, out)) == 2 * STEPS * 2 + STEPS * 3, k
    assert re.search(r"CHECK ok joined\.b%d: rank 2/3" % STEPS, out), out[-3000:]   # the new worker
    assert len(re.findall(r"CHECK ok world\.changed\.b%d:" % STEPS, out)) == 2       # grow: 2 survivors
    assert len(re.findall(r"CHECK ok world\.changed\.b%d:" % (2 * STEPS), out)) == 2  # shrink
    # the two surviving ranks and the added one end cleanly; reduction=auto decided once per phase, for
    # each of the two optimizers that use it (hvd_quant's and the stock path's)
    assert len(re.findall(r"DONE rank \d/2 batch %d" % (3 * STEPS), out)) == 2, out[-3000:]
    chose = re.findall(r"reduction=auto chose", out)
    assert len(chose) == 2 * 3, out[-3000:]
    for k in ("qsgd_auto", "stock_auto"):
        assert len(re.findall(r"CHECK ok auto\.measuring\.%s\.b(?:%d|%d):" % (k, STEPS, 2 * STEPS), out)) == 5
    # error-feedback residuals across the changes (1-bit SRA)
    assert len(re.findall(r"CHECK ok residuals\.worker_kept\.b", out)) == 4
    assert re.search(r"CHECK ok residuals\.fresh\.b%d:" % STEPS, out)
    fresh = r"CHECK ok residuals\.server_rule\.b%d: .* no server residual" % STEPS
    assert len(re.findall(fresh, out)) == 2
    assert len(re.findall(r"CHECK ok residuals\.server_rule\.b%d: .* continues" % (2 * STEPS), out)) == 2
