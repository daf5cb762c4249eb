"""The membership schedule of the elastic workers (torch_elastic.py, tf_elastic.py).

The host-discovery script prints the hosts file ``HVDQ_ELASTIC_HOSTS``, which rank 0 rewrites when
the schedule says so (as Horovod's own elastic tests do): ``PHASE_STEPS`` steps at each size of
``SIZES``. Horovod starts a worker and raises ``HostsUpdatedInterrupt`` when a slot is added, and
removes the worker of the last slot when one is taken away.
"""
import os
import time

HOSTS = os.environ["HVDQ_ELASTIC_HOSTS"]
PHASE_STEPS = int(os.environ.get("HVDQ_ELASTIC_STEPS", "20"))
SIZES = (2, 3, 2)
TOTAL = PHASE_STEPS * len(SIZES)
WAIT_S = float(os.environ.get("HVDQ_ELASTIC_WAIT_S", "90"))


def write_hosts(slots):
    tmp = HOSTS + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"localhost:{slots}\n")
    os.replace(tmp, HOSTS)


def wait_for_change(state):
    """Poll until Horovod raises HostsUpdatedInterrupt (every rank at the same poll)."""
    t0 = time.monotonic()
    while True:
        state.check_host_updates()
        if time.monotonic() - t0 > WAIT_S:
            raise RuntimeError(f"no membership change within {WAIT_S}s")
        time.sleep(0.25)


def next_phase(state, b, rank):
    """At batch ``b``, the first of the next phase: rank 0 rewrites the hosts file, every rank commits
    and waits for the change (Horovod's interrupt leaves this function). ``state.phase`` counts the
    phases."""
    if b != PHASE_STEPS * (state.phase + 1):
        return
    state.phase += 1
    if rank == 0:
        write_hosts(SIZES[state.phase])
        print(f"PHASE {state.phase}: rank 0 wrote localhost:{SIZES[state.phase]} at batch {b}", flush=True)
    state.commit()
    wait_for_change(state)
