"""The suite's slow subprocess children (the kernels and the codecs' device path in Numba's CUDA
simulator), started in the background as soon as pytest has collected a test that reads one, at the
lowest CPU priority (nice 19): they use the CPU the rest of the suite leaves idle, and the fixture
that reads a child's output waits for it (its timeout counts from then).

A child is ``python <args>`` run from the repository root with ``ROOT`` on ``PYTHONPATH``; it is
named by the test module and the fixture that reads it. ``HVDQ_REAL_CUDA=1`` runs the kernel
children on the real GPU instead of the simulator.

Under pytest-xdist (``-n 2``) no worker knows at collection which tests it will be given, and two
workers must not both run a child: the tests that read a child form one ``xdist_group``
(tests/conftest.py; ``--dist loadgroup`` hands the largest groups out first), and the worker that
runs them starts the child when the first asks for it (at normal priority: the worker waits).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _sim():
    return {} if os.environ.get("HVDQ_REAL_CUDA") == "1" else {"NUMBA_ENABLE_CUDASIM": "1"}


def _child_of(module):
    return ["-c", f"import tests.{module} as t; t._child()"]


# (test module, fixture) -> (arguments after python, extra environment, timeout once awaited, s)
CHILDREN = {
    ("test_kernels", "cuda_results"): (_child_of("test_kernels"), _sim, 600),
    ("test_fused_kernels", "cuda_results"): (_child_of("test_fused_kernels"), _sim, 1200),
    ("test_codec_cuda_sim", "results"): (_child_of("test_codec_cuda_sim"),
                                         lambda: {"NUMBA_ENABLE_CUDASIM": "1"}, 900),
}

_running = {}       # key -> (Popen, stdout file, stderr file)


def _start(key, nice=19):
    if key in _running:
        return
    args, extra, _ = CHILDREN[key]
    env = dict(os.environ, **extra())
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=out, stderr=err,
                            stdin=subprocess.DEVNULL, preexec_fn=lambda: os.nice(nice))
    _running[key] = (proc, out, err)


def key_of(item):
    """The (module, fixture) of the child that test ``item`` reads, or None."""
    stem = Path(str(item.fspath)).stem
    return next(((stem, name) for name in getattr(item, "fixturenames", ()) if (stem, name) in CHILDREN),
                None)


def start(items):
    """Starts the child of every (module, fixture) that one of the collected ``items`` uses."""
    for key in {key_of(item) for item in items} - {None}:
        _start(key)


def result(module, fixture):
    """The child's ``subprocess.CompletedProcess`` (text output), waiting for it to end."""
    key = (module, fixture)
    _start(key, nice=0)
    proc, out, err = _running[key]
    try:
        proc.wait(timeout=CHILDREN[key][2])
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    out.seek(0)
    err.seek(0)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out.read(), err.read())


def json_result(module, fixture):
    """The JSON the child printed as its last line, once it has ended with status 0."""
    r = result(module, fixture)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def stop():
    """Ends the children still running (a session stopped early)."""
    for proc, _, _ in _running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
