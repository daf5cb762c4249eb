"""Start real Horovod jobs from tests.

``run_horovod(script, np=2, controller="gloo")`` launches ``script`` (a path under tests/workers or any
Python file) as ``np`` real Horovod processes, with ``horovodrun --gloo`` or with OpenMPI's ``mpirun``,
waits at most ``timeout`` seconds (killing the whole process group on expiry, so a hang fails the test
instead of stalling CI), and returns the completed process with stdout and stderr captured.

Every worker is expected to exit 0 on success; ``check=True`` asserts that and shows the output of all
ranks when it does not.

``run_driver(runs, tmp_path)`` runs several runs of the PyTorch example driver in one 2-rank job, so
the world and the imports start once for all of them.
"""
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent

CONTROLLERS = ("gloo", "mpi")


def _tool(name):
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise RuntimeError(f"{name} not found next to {sys.executable} nor on PATH; run scripts/bootstrap.sh")
    return found


@functools.lru_cache(maxsize=None)
def _gloo_built():
    """Horovod's own probe (a forked process that imports its extensions), once per test process."""
    from horovod.common.util import gloo_built
    return bool(gloo_built())


def horovodrun():
    """The launcher of Gloo jobs: tests/horovodrun.py (Horovod's launcher; its build probe answered
    by :func:`_gloo_built`, see ``horovod_env``)."""
    return [sys.executable, str(Path(__file__).resolve().parent / "horovodrun.py")]


def horovod_env(extra=None):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    # Name stalled tensors after 5 s; end a job stalled for 300 s (the tests' own timeouts are longer)
    # instead of hanging. Not 30 s: ranks compiling kernels cold on 2 shared cores were that late.
    env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", "5")
    env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "300")
    # Gloo gives up on a peer after 30 s by default. A rank's Horovod thread waits for the GIL where
    # it frees a tensor whose Python object is gone, and a cold Numba compile holds the GIL for
    # seconds at a time: on 2 shared cores, ranks compiling at once beside another job stalled a
    # 3-rank job for over 120 s (CI, a cold cache; tests/conftest.py now runs one job at a time),
    # which is not a hang.
    env.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", "300")
    if _gloo_built():
        env["HVDQ_GLOO_BUILT"] = "1"       # tests/horovodrun.py: no probe at every launch
    # Keep each rank on one thread: 2 cores are shared by all ranks.
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        env.setdefault(var, "1")
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
    env.setdefault("TF_NUM_INTEROP_THREADS", "1")
    # OpenMPI as root, more ranks than cores.
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    if extra:
        env.update({k: str(v) for k, v in extra.items()})
    return env


# Emulated nodes on this machine: host names Horovod and OpenMPI take for different hosts.
NODE_HOSTS = {"gloo": ("localhost", "127.0.0.1"), "mpi": ("127.0.0.2", "127.0.0.3")}
MPI_AGENT = ROOT / "horovodrun_configs" / "multinode" / "local_agent.sh"


def horovod_command(script, np=2, controller="gloo", args=(), nodes=1):
    """``nodes`` > 1: the ranks on that many emulated hosts of ``np // nodes`` ranks (Gloo: two names
    of this machine; OpenMPI: a hostfile of two loopback addresses and a launch agent that runs each
    host's daemon here), so local and cross ranks are as on a cluster."""
    script = str(script)
    if not os.path.isabs(script) and not os.path.exists(script):
        script = str(WORKERS / script)
    py = [sys.executable, script, *map(str, args)]
    if nodes > 1 and (nodes > 2 or np % nodes):
        raise ValueError(f"emulated nodes: 2 nodes of equal size, got np={np}, nodes={nodes}")
    hosts = [f"{h}:{np // nodes}" for h in NODE_HOSTS[controller][:nodes]] if nodes > 1 else None
    if controller == "gloo":
        return [*horovodrun(), "-np", str(np), "-H", ",".join(hosts or [f"localhost:{np}"]),
                "--gloo", *py]
    if controller == "mpi":
        where = ["-H", ",".join(hosts), "--mca", "plm_rsh_agent", str(MPI_AGENT), "-x", "PATH",
                 "-x", "PYTHONPATH"] if hosts else []
        return [_tool("mpirun"), "-np", str(np), *where, "--oversubscribe", "--bind-to", "none",
                "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo",
                "--mca", "oob_tcp_if_include", "lo", *py]
    raise ValueError(f"controller must be one of {CONTROLLERS}, got {controller!r}")


def run_horovod(script, np=2, controller="gloo", args=(), env=None, timeout=240, check=True,
                keep_cr=False, nodes=1):
    cmd = horovod_command(script, np=np, controller=controller, args=args, nodes=nodes)
    return run_command(cmd, env=env, timeout=timeout, check=check, keep_cr=keep_cr)


def run_driver(runs, tmp_path, np=2, timeout=600):
    """Runs ``[(name, driver arguments)]`` of examples/pytorch/train.py one after the other in one
    Horovod job (tests/workers/driver_runs.py). Returns the completed process and ``{name: the job's
    output lines from that run's start to the next one's}`` (rank 0 marks the starts)."""
    spec = Path(tmp_path) / "driver_runs.json"
    spec.write_text(json.dumps([[name, [str(a) for a in argv]] for name, argv in runs]))
    result = run_horovod("driver_runs.py", np=np, args=[spec], timeout=timeout)
    sections, current = {}, None
    for line in result.stdout.splitlines(keepends=True):
        start = re.match(r"\[0\]<stdout>:== RUN (\S+)$", line.rstrip("\n"))
        if start:
            current = start.group(1)
            sections[current] = ""
        elif current is not None:
            sections[current] += line
    assert list(sections) == [name for name, _ in runs], result.stdout[-3000:]
    return result, sections


def run_command(cmd, env=None, timeout=240, check=True, keep_cr=False):
    """Run a launcher command line (``horovod_env(env)``, from the repository root) as ``run_horovod``.
    ``keep_cr``: keep carriage returns in the output (text mode would turn them into newlines)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=not keep_cr,
                            env=horovod_env(env), cwd=str(ROOT), start_new_session=True)
    text = (lambda b: b.decode(errors="replace")) if keep_cr else (lambda t: t)
    try:
        out, err = map(text, proc.communicate(timeout=timeout))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = map(text, proc.communicate())
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout}s\n--- stdout\n{out[-6000:]}"
                             f"\n--- stderr\n{err[-6000:]}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{out[-8000:]}"
                             f"\n--- stderr\n{err[-8000:]}")
    return result
