"""Worker: the last rank SIGKILLs itself in the middle of a step with hvd_quant's optimizer.

argv[1] says where: ``hook`` (in a gradient hook during backward: the others have started their
first-phase collectives for the step, the victim never submits its own) or ``advance`` (SRA, between
the two phases: every rank's alltoall is done, the victim dies before submitting its allgather).

The survivors must not hang in hvd_quant code: Horovod reports the lost peer as an error
(``HorovodInternalError``), which each survivor prints as ``SURVIVOR <rank> <exception type> <seconds
since the victim's death>`` before exiting 3 at once (its closed sockets tell the other survivors); the launcher ends the job too. tests/test_torch_patterns.py
bounds the time the whole job takes.
"""
import faulthandler
import os
import signal
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import horovod.torch as hvd

import hvd_quant
import hvd_quant.torch as hqt

from torch_common import init

faulthandler.dump_traceback_later(float(os.environ.get("HVDQ_TEST_HANG_S", "170")), exit=True)
# A survivor the launcher terminates first shows where it was waiting.
if os.environ.get("HVDQ_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, lambda *a: print(f"TERM {hvd.rank()} ignored", flush=True))
else:
    faulthandler.register(signal.SIGTERM, all_threads=False, chain=True)
R, N = init()
WHERE = sys.argv[1] if len(sys.argv) > 1 else "hook"
VICTIM, KILL_STEP = N - 1, 2
DEATH_FILE = os.environ.get("HVDQ_TEST_DEATH_FILE")      # the victim writes its time of death there


def die():
    if DEATH_FILE:
        with open(DEATH_FILE, "w") as f:
            f.write(repr(time.time()))
    print(f"VICTIM {R} kills itself ({WHERE})", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
opt = hqt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(),
                               compression=hvd_quant.QSGD(bits=4), bucket_bytes=8192,
                               reduction="sra")
step = [0]
if R == VICTIM and WHERE == "hook":
    model[0].weight.register_hook(lambda g: die() if step[0] == KILL_STEP else None)
if R == VICTIM and WHERE == "advance":
    exchange = opt._exchange_for("sra")
    advance = exchange.advance

    def advance_then_die(p):
        if step[0] == KILL_STEP and p.stage == "first":
            exchange.coll.synchronize(p.handle)      # the alltoall completed everywhere
            die()
        return advance(p)
    exchange.advance = advance_then_die

t0 = time.time()
try:
    for step[0] in range(6):
        opt.zero_grad()
        x, y = torch.randn(16, 32), torch.randint(0, 10, (16,))
        F.cross_entropy(model(x), y).backward()
        opt.step()
        print(f"STEP {R} {step[0]} {time.time():.2f}", flush=True)
except Exception as e:  # noqa: BLE001 -- report whatever Horovod raised, then fail
    died = float(open(DEATH_FILE).read()) if DEATH_FILE and os.path.exists(DEATH_FILE) else t0
    print(f"SURVIVOR {R} {type(e).__name__} {time.time() - died:.2f}: {str(e)[:200]}", flush=True)
    # Leave at once, as a process killed by its error would: Horovod's exit-time shutdown can wait on a
    # collective with a survivor that has not seen the error yet, keeping this rank's sockets open
    # (Gloo's timeout is 300 s here), so that survivor would hear of the death only from the launcher.
    os._exit(3)
print(f"NO-ERROR {R}", flush=True)
