"""Benchmark: training speed (img/sec) of every exchange method, through one harness and one timing.

    python -m hvd_quant.bench train                          # GPU: all GPUs, resnet50, vgg16, vit_b_16
    python -m hvd_quant.bench train --list                   # the config ids it would run
    python -m hvd_quant.bench train --only 'resnet50/nvlink/*'           # one part (fits a short call)
    python -m hvd_quant.bench train --np 1 --force-exchange  # world size 1, exchange forced
    python -m hvd_quant.bench train --device cpu --np 2      # CPU: Gloo over loopback, cpu_resnet
    python -m hvd_quant.bench train --plot bench-train/train.csv         # redraw the chart

Every configuration runs as its own job (a subprocess; its output goes to ``DIR/logs/<id>.log``) of
the same worker, ``python -m hvd_quant.bench._train_worker``, which times training the way Horovod's
``examples/pytorch/pytorch_synthetic_benchmark.py`` does: one synthetic batch per rank kept on the
device, SGD lr 0.01, ``--num-warmup-batches`` untimed steps, then ``--num-iters`` iterations of
``--num-batches-per-iter`` steps; img/sec = batch * batches_per_iter / time of the iteration (on CUDA
the device is synchronised at the end of each iteration), reported per rank as mean +- 1.96 * std
over the iterations, as rank 0 measured it; total = per-rank mean * N.

Config ids are ``<model>/<network>/<method>``. Methods:

  single                 one process, no Horovod, no exchange (the physical limit per rank);
                         runs once per model, id ``<model>/local/single``
  ddp-fp32               torch DDP (NCCL on GPU, Gloo on CPU), launched by torch.distributed.run
  ddp-fp16               DDP with the fp16_compress_hook
  ddp-powersgd<R>        DDP with the PowerSGD hook, matrix_approximation_rank=R, start_powerSGD_iter=2
                         (the earliest PyTorch allows; the warm-up steps cover the fp32 start); on
                         Gloo in one DDP bucket (with several, the ranks' collectives come in
                         different orders)
  ddpq-<codec>-<red>     DDP with hvd_quant.torch.ddp_comm_hook(<codec>, reduction=<red>)
  hvd-fp32, hvd-fp16     hvd.DistributedOptimizer(compression=hvd.Compression.none / .fp16)
  stock-<codec>          hvd.DistributedOptimizer(compression=<hvd_quant codec>) (the stock path)
  stock-<codec>-<red>    the same with compression=hvd_quant.StockCompression(<codec>, reduction=<red>)
  hvdq-<codec>-<red>     hvd_quant.torch.DistributedOptimizer(compression=<codec>, reduction=<red>)
                         (<red> is passed through as written: sra, allgather, auto, ...)
  onebit-adam            hvd_quant.torch.OneBitAdam (its defaults), the variance frozen halfway
                         through the warm-up, so the timed steps send the momentum in 1 bit

with <codec> one of qsgd8, qsgd4, qsgd2 (hvd_quant.QSGD(bits=...)) and onebit (hvd_quant.OneBit()), all
with their default settings. Horovod-based methods run under ``horovodrun -np N -H localhost:N``
(``--gloo`` on CPU); a method id the driver does not know is recorded as a failed row.

Models: on GPU resnet50, vgg16, vit_b_16 (torchvision; 224 px, batch 64 per GPU, 1000 classes); on
CPU ``cpu_resnet`` (a ResNet-18-like net defined in the worker: 38 parameter tensors, ~2.8M
parameters; 32 px, batch 16, 10 classes), ``mlp`` (tiny, for tests) and ``mlp_wide`` (hidden width
2048: 10.5M parameters at 32 px). ``--optimizer adam`` makes every method wrap torch.optim.Adam
instead of SGD (the comparison for ``onebit-adam``).

``--slownet RATE`` (CPU, root) runs each Horovod and DDP job through ``scripts/slownet.py --rate RATE``
(``--torch`` for DDP): one network namespace per rank, Gloo over rate-limited links; with ``--nodes K``,
K namespaces (emulated nodes) of N/K ranks each, the rate limit between nodes only. Each rank's log
then gives the bytes its node's link carried per timed step (``Link bytes per step``; rank 0's in the
result line).

Networks (N >= 2): ``nvlink`` (NCCL as it comes) and ``sockets`` (NCCL_P2P_DISABLE=1
NCCL_SHM_DISABLE=1) on GPU; ``loopback`` on CPU (Gloo). Every GPU job gets NCCL_NVLS_ENABLE=0
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1.

World size 1 with the exchange forced (``--np 1 --force-exchange``, network label ``ws1-forced``):
Horovod and hvd_quant skip the gradient exchange at size 1 unless HOROVOD_ELASTIC=1. With that
variable set and the worker started by plain ``python`` (not horovodrun), both optimizers register
their hooks at size 1, so the whole compressed exchange (encode, collectives of one rank, decode)
runs with nothing to send: the exchange's own cost beside ``single``. DDP configs run through
torch.distributed.run with one process as usual; ``single`` is the no-exchange baseline. Without
``--force-exchange``, ``--np 1`` runs under horovodrun -np 1 (label ``ws1``): no exchange at all.

Ratios (per-rank img/sec): ``vs_best_peer`` = this / the best peer on the same model, network and N,
where the peers are ddp-* and hvd-* (not single, not the hvd_quant codecs); ``vs_single`` = this /
``single`` of the same model and N (the scaling efficiency).

Every job also checks that its ranks end with bit-identical parameters (column ``replicas``:
``identical``, ``DIFFER``, or ``one`` for one process; the worker compares SHA-256 digests).

Output (``--out DIR``, default ``bench-train/``): one line per finished config, a final table,
``DIR/train.csv`` (each finished row appended at once; ratios refreshed at the end of a run),
``DIR/logs/``, and the bar chart ``DIR/train.png`` when matplotlib is importable. A run resumes: a
config whose id (at the same N) already has a row with status ok is skipped unless ``--fresh``;
failed and timed-out configs run again. ``--repeat R`` runs every config R times (a config with k ok
rows runs R - k more), pass by pass, each pass in the reverse order of the one before, so that a
drift of the machine over the run falls on every config alike; the table (columns ``runs``: ok jobs
of the last R, ``range``: their per-rank img/sec), the ratios and the chart then report each config's
median job of its last R runs (the lower median, one job's row as it was written; ``replicas`` DIFFER
if any of them differed); every job keeps its CSV row and its log (``<stem>.<k>.log`` for the k-th).
``--only PATTERN[,PATTERN]`` (fnmatch on the id) picks a part; ``--timeout`` (default 300 s) kills a
job's whole process group and records a ``timeout`` row.
"""
import argparse
import csv
import fnmatch
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hvd_quant.bench._train_worker import (CPU_MODELS, GPU_MODELS, RESULT_PREFIX, parse_method)

WORKER = "hvd_quant.bench._train_worker"
DEFAULT_METHODS = ("single", "ddp-fp32", "ddp-fp16", "ddp-powersgd4", "ddpq-qsgd4-auto", "ddpq-qsgd4-sra",
                   "hvd-fp32", "hvd-fp16",
                   "stock-qsgd4", "hvdq-qsgd4-sra", "hvdq-qsgd4-allgather", "hvdq-qsgd4-auto",
                   "hvdq-qsgd8-auto", "hvdq-onebit-allgather")
GPU_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
NETWORK_ENV = {"nvlink": {}, "sockets": {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1"},
               "loopback": {}, "ws1": {}, "ws1-forced": {"HOROVOD_ELASTIC": "1"}, "local": {}}
# Warm-up covers reduction="auto"'s 18 steps, 24 with two_level (hvd_quant.scheduler.AutoChoice), for every method alike
GPU_DEFAULTS = dict(models="resnet50,vgg16,vit_b_16", batch_size=64, image_size=224, num_classes=1000,
                    num_warmup_batches=25, num_batches_per_iter=10, num_iters=10)
CPU_DEFAULTS = dict(models="cpu_resnet", batch_size=16, image_size=32, num_classes=10,
                    num_warmup_batches=25, num_batches_per_iter=5, num_iters=5)
COLUMNS = ("id", "model", "network", "np", "procs", "method", "status", "img_per_sec", "conf",
           "total_img_per_sec", "vs_best_peer", "best_peer", "vs_single", "bytes_ratio", "replicas",
           "seconds", "error", "device", "batch_size", "image_size", "model_source", "finished", "log",
           "command")
ROOT = Path(__file__).resolve().parents[2]      # the directory holding the hvd_quant package


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_quant.bench train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="auto: cuda when available")
    p.add_argument("--np", type=int, default=None, help="world size N (default: the GPUs; 2 on CPU)")
    p.add_argument("--force-exchange", action="store_true",
                   help="with --np 1: run the exchange at size 1 (HOROVOD_ELASTIC=1, plain python)")
    p.add_argument("--models", default=None, help="comma-separated (default: GPU "
                   f"{GPU_DEFAULTS['models']}; CPU {CPU_DEFAULTS['models']})")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS), help="comma-separated method ids")
    p.add_argument("--networks", default=None,
                   help="comma-separated (default: nvlink,sockets on GPU, loopback on CPU)")
    p.add_argument("--only", default=None, help="PATTERN[,PATTERN]: run only ids matching (fnmatch)")
    p.add_argument("--list", action="store_true", help="print the ids that would run, then exit")
    p.add_argument("--fresh", action="store_true", help="run configs already ok in the CSV again")
    p.add_argument("--repeat", type=int, default=1, metavar="R",
                   help="run every config R times, each pass in the reverse order of the pass before "
                        "(a drift of the machine falls on every config alike); the table, the ratios and "
                        "the chart take each config's median job of its last R runs (default 1)")
    p.add_argument("--out", default="bench-train", help="output directory (default bench-train/)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per job (default 300)")
    p.add_argument("--batch-size", type=int, default=None, help="per rank (GPU 64, CPU 16)")
    p.add_argument("--image-size", type=int, default=None, help="GPU 224, CPU 32")
    p.add_argument("--num-classes", type=int, default=None, help="GPU 1000, CPU 10")
    p.add_argument("--num-warmup-batches", type=int, default=None, help="25: past auto's measured steps")
    p.add_argument("--num-batches-per-iter", type=int, default=None, help="GPU 10, CPU 5")
    p.add_argument("--num-iters", type=int, default=None, help="GPU 10, CPU 5")
    p.add_argument("--threads", type=int, default=None,
                   help="CPU threads per process (default: this host's cores / N)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="what every method wraps (onebit-adam is Adam itself)")
    p.add_argument("--slownet", metavar="RATE", default=None,
                   help="CPU, root: Horovod and DDP jobs through scripts/slownet.py at this link rate (1gbit)")
    p.add_argument("--slownet-prefix", default="hq",
                   help="slownet.py's --prefix (its namespace names): jobs of two runs at once need two")
    p.add_argument("--nodes", type=int, default=None,
                   help="with --slownet: emulated nodes of np/nodes ranks each, the slow link between them")
    p.add_argument("--controller", choices=("auto", "gloo", "mpi"), default="auto",
                   help="horovodrun controller (auto: --gloo on CPU, horovodrun's choice on GPU)")
    p.add_argument("--trace", action="store_true",
                   help="each job also profiles 3 steps after the timed ones: DIR/traces/<id>.rank<r>.json.gz "
                        "(Chrome trace), <id>.horovod.json (Horovod timeline), the top ops in its log")
    p.add_argument("--no-timeline", action="store_true",
                   help="with --trace: no Horovod timeline (with it on, Horovod waits for a collective's "
                        "inputs on the host, so the traced steps run slower than the timed ones)")
    p.add_argument("--progress-every", type=float, default=30, help="seconds between progress lines")
    p.add_argument("--plot", metavar="CSV", default=None, help="only draw the chart of this CSV")
    p.add_argument("--no-plot", action="store_true", help="do not draw the chart after the run")
    return p


# ---- configurations ----------------------------------------------------------------------------------

class Config:
    def __init__(self, model, network, method, np_, spec=None, error=None):
        self.model, self.network, self.method, self.np = model, network, method, np_
        self.spec, self.error = spec, error
        self.id = f"{model}/{network}/{method}"

    @property
    def procs(self):
        return 1 if self.method == "single" else self.np

    @property
    def key(self):
        return (self.id, str(self.np))


def plan(args):
    """The configs of this invocation, in run order (per model: single, then per network the methods)."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    known = GPU_MODELS + CPU_MODELS
    for m in models:
        if m not in known:
            raise SystemExit(f"unknown model {m!r}; known: {', '.join(known)}")
    if args.np == 1:
        networks = ["ws1-forced" if args.force_exchange else "ws1"]
    elif args.networks:
        networks = [n.strip() for n in args.networks.split(",") if n.strip()]
    elif args.slownet:
        networks = [f"slownet-{args.slownet}"]
    else:
        networks = ["nvlink", "sockets"] if args.device == "cuda" else ["loopback"]
    allowed = ("nvlink", "sockets") if args.device == "cuda" else ("loopback", f"slownet-{args.slownet}")
    for n in networks:
        if n not in allowed and args.np != 1:
            raise SystemExit(f"network {n!r} is not one of {', '.join(allowed)} on {args.device}")
    out = []
    for model in models:
        if "single" in methods:
            out.append(Config(model, "local", "single", args.np, parse_method("single")))
        for net in networks:
            for m in methods:
                if m == "single":
                    continue
                try:
                    out.append(Config(model, net, m, args.np, parse_method(m)))
                except ValueError as e:
                    out.append(Config(model, net, m, args.np, None, str(e)))
    if args.only:
        pats = [p.strip() for p in args.only.split(",") if p.strip()]
        out = [c for c in out if any(fnmatch.fnmatchcase(c.id, p) for p in pats)]
    return out


def _tool(name):
    path = Path(sys.executable).parent / name
    if path.exists():
        return str(path)
    return shutil.which(name)


def command(cfg, args):
    """``(argv, extra_env)`` of the job for ``cfg``."""
    worker = ["-m", WORKER, "--method", cfg.method, "--model", cfg.model, "--device", args.device,
              "--batch-size", args.batch_size, "--image-size", args.image_size,
              "--num-classes", args.num_classes, "--num-warmup-batches", args.num_warmup_batches,
              "--num-batches-per-iter", args.num_batches_per_iter, "--num-iters", args.num_iters,
              "--optimizer", args.optimizer]
    if args.device == "cpu":
        worker += ["--threads", args.threads]
    if args.trace:
        worker += ["--trace", Path(args.out).resolve() / "traces" / file_stem(cfg)]
    worker = [str(a) for a in worker]
    env = dict(NETWORK_ENV.get(cfg.network, {}))
    if args.trace and not args.no_timeline:
        env["HOROVOD_TIMELINE"] = "DYNAMIC"     # hvd.start_timeline at the traced steps
    if args.device == "cuda":
        env.update(GPU_ENV)
    if args.device == "cpu":
        for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
            env[var] = str(args.threads)
    launcher = cfg.spec["launcher"]
    py = sys.executable
    if launcher == "single":
        env.pop("HOROVOD_ELASTIC", None)
        return [py, *worker], env
    if launcher == "ddp":
        env.pop("HOROVOD_ELASTIC", None)
    slow = args.slownet and cfg.network != "ws1-forced"
    if slow:        # slownet starts the ranks itself, each in its namespace (torch.distributed: env://)
        return [py, str(ROOT / "scripts" / "slownet.py"), "--np", str(cfg.np), "--rate", args.slownet,
                "--prefix", args.slownet_prefix, "--timeout", str(args.timeout),
                *(["--nodes", str(args.nodes)] if args.nodes else []),
                *(["--torch"] if launcher == "ddp" else []), "--", py, *worker], env
    if launcher == "ddp":
        return [py, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(cfg.np),
                *worker], env
    if cfg.network == "ws1-forced":
        return [py, *worker], env
    hr = _tool("horovodrun") or "horovodrun"
    ctl = args.controller
    if ctl == "auto":
        ctl = "gloo" if args.device == "cpu" else None
    flag = [f"--{ctl}"] if ctl else []
    return [hr, "-np", str(cfg.np), "-H", f"localhost:{cfg.np}", *flag, py, *worker], env


def job_env(extra):
    env = dict(os.environ)
    env.pop("HOROVOD_ELASTIC", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # OpenMPI (horovodrun's MPI controller) as root, more ranks than cores
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT", "1")
    env.setdefault("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
    env.setdefault("OMPI_MCA_rmaps_base_oversubscribe", "1")
    env.update(extra)
    return env


def command_text(argv, extra):
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in sorted(extra.items())] + [shlex.join(argv)])


# ---- running one job ---------------------------------------------------------------------------------

def _descendants(pid):
    """Every live process below ``pid`` (Linux /proc), found before anything is killed."""
    children = {}
    try:
        for d in os.listdir("/proc"):
            if not d.isdigit():
                continue
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d))
    except OSError:
        return []
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def kill_job(proc):
    """End the job: its process group and every process it started (SIGTERM, then SIGKILL)."""
    pids = [proc.pid] + _descendants(proc.pid)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        try:
            proc.wait(timeout=5)
            if sig == signal.SIGTERM:
                time.sleep(0.5)     # let the launcher's children go too
        except subprocess.TimeoutExpired:
            pass
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


_PREFIX = re.compile(r"^\[\d+(?:,\d+)?\]<(stdout|stderr)>:")
_ERROR = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Exit)|Killed|Segmentation fault)\b")
_GENERIC = ("Horovod detected that one or more processes exited", "ChildFailedError",
            "CalledProcessError", "subprocess.CalledProcessError")


def _clean(line):
    return _PREFIX.sub("", line.rstrip("\n")).strip()


def last_error(text):
    """The last line that names an error, the launchers' generic ones aside; else the last line."""
    lines = [_clean(x) for x in text.splitlines()]
    lines = [x for x in lines if x]
    for x in reversed(lines):
        if _ERROR.match(x) and not any(g in x for g in _GENERIC):
            return x[:300]
    for x in reversed(lines):
        if not any(g in x for g in _GENERIC):
            return x[:300]
    return lines[-1][:300] if lines else ""


def parse_result(text):
    found = None
    for line in text.splitlines():
        line = _clean(line)
        if line.startswith(RESULT_PREFIX):
            found = line[len(RESULT_PREFIX):]
    return json.loads(found) if found else None


def file_stem(cfg):
    return cfg.id.replace("/", "__")


def log_name(cfg, logs):
    """The job's log in directory ``logs``: ``<stem>.log``, or ``<stem>.<k>.log`` for the config's k-th
    job there (a rerun or ``--repeat`` keeps the earlier logs)."""
    name, k = file_stem(cfg) + ".log", 1
    while (logs / name).exists():
        k += 1
        name = f"{file_stem(cfg)}.{k}.log"
    return name


def run_job(cfg, args, out_dir, index, total):
    """Run one config; returns its CSV row (a dict)."""
    row = dict(id=cfg.id, model=cfg.model, network=cfg.network, np=cfg.np, procs=cfg.procs,
               method=cfg.method, device=args.device, batch_size=args.batch_size,
               image_size=args.image_size)
    head = f"[{index}/{total}] {cfg.id} (N={cfg.np})"
    if cfg.spec is None:
        print(f"{head}: not run: {cfg.error}", flush=True)
        row.update(status="failed", error=cfg.error, seconds=0.0, command="")
        return row
    argv, extra = command(cfg, args)
    if argv[0] == "horovodrun" and not shutil.which("horovodrun"):
        msg = "horovodrun not found next to this Python nor on PATH"
        print(f"{head}: not run: {msg}", flush=True)
        row.update(status="failed", error=msg, seconds=0.0, command=command_text(argv, extra))
        return row
    log_path = out_dir / "logs" / log_name(cfg, out_dir / "logs")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    row.update(command=command_text(argv, extra), log=str(Path("logs") / log_path.name))
    print(f"{head}: running ({cfg.spec['launcher']}; log {log_path})", flush=True)
    t0 = time.monotonic()
    status = None
    with open(log_path, "w") as logf:
        logf.write(f"# {row['command']}\n")
        logf.flush()
        proc = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=job_env(extra), start_new_session=True)
        next_note, before = t0 + args.progress_every, ""
        try:
            while proc.poll() is None:
                time.sleep(0.25)
                now = time.monotonic()
                if now - t0 > args.timeout:
                    before = _last_line(log_path)
                    kill_job(proc)
                    status = "timeout"
                    break
                if now >= next_note:
                    next_note += args.progress_every
                    print(f"    ... {cfg.id}: {now - t0:.0f} s; last output: {_last_line(log_path)}",
                          flush=True)
        except BaseException:       # Ctrl-C: leave nothing running
            kill_job(proc)
            raise
    seconds = time.monotonic() - t0
    text = log_path.read_text(errors="replace")
    result = parse_result(text)
    row["seconds"] = round(seconds, 1)
    if status == "timeout":
        row.update(status="timeout", error=f"timed out after {args.timeout:g} s; last output: {before}"[:300])
    elif proc.returncode == 0 and result is not None:
        row.update(status="ok", error="", img_per_sec=result["img_per_sec"], conf=result["conf"],
                   total_img_per_sec=result["total_img_per_sec"], bytes_ratio=result.get("bytes_ratio"),
                   replicas=result.get("replicas", ""), model_source=result.get("model_source", ""))
    else:
        why = last_error(text) if proc.returncode != 0 else "no result line"
        row.update(status="failed", error=f"exit {proc.returncode}: {why}"[:300])
    return row


def _last_line(path):
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = [_clean(x) for x in f.read().decode(errors="replace").splitlines()]
        lines = [x for x in lines if x]
        return lines[-1][:160] if lines else "(none yet)"
    except OSError:
        return "(no log)"


# ---- CSV, ratios, table ------------------------------------------------------------------------------

def read_rows(path):
    if not Path(path).exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def append_row(path, row):
    new = not Path(path).exists() or Path(path).stat().st_size == 0
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerow({k: _fmt(row.get(k)) for k in COLUMNS})


def write_rows(path, rows):
    tmp = Path(str(path) + ".tmp")
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _fmt(r.get(k)) for k in COLUMNS})
    os.replace(tmp, path)


def _fmt(v):
    if v is None:
        return ""
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.6g}"
    return v


def _num(v):
    try:
        x = float(v)
        return None if math.isnan(x) else x
    except (TypeError, ValueError):
        return None


def is_peer(method):
    return method.startswith("ddp-") or method.startswith("hvd-")


def current(rows, repeat=1):
    """Each (id, np)'s row as reported, in the order of their last rows: of its last ``repeat`` rows,
    the median job of those with status ok (the lower median: a row as one job wrote it), with
    ``runs`` ("ok of run"), ``low`` and ``high`` (the ok jobs' img/sec range) and ``replicas`` DIFFER
    where any of them differed; its last row where none of them is ok."""
    by_key = {}
    for r in rows:
        k = (r["id"], str(r["np"]))
        runs = by_key.pop(k, [])        # re-inserted: the order of the last rows, as before
        runs.append(r)
        by_key[k] = runs
    out = {}
    for k, runs in by_key.items():
        runs = runs[-max(1, repeat):]
        ok = sorted((r for r in runs if r.get("status") == "ok" and _num(r.get("img_per_sec")) is not None),
                    key=lambda r: _num(r["img_per_sec"]))
        if not ok:
            out[k] = runs[-1]
            continue
        m = out[k] = dict(ok[(len(ok) - 1) // 2])
        m["runs"], m["low"], m["high"] = f"{len(ok)}/{len(runs)}", ok[0]["img_per_sec"], ok[-1]["img_per_sec"]
        if any(r.get("replicas") == "DIFFER" for r in ok):
            m["replicas"] = "DIFFER"
    return out


def run_order(todo, need):
    """Pass k runs the configs of ``todo`` that need at least k more jobs (``need``: key -> count),
    each pass in the reverse order of the pass before."""
    order = []
    for k in range(1, max(need.values(), default=0) + 1):
        seq = [c for c in todo if need[c.key] >= k]
        order += seq if k % 2 else seq[::-1]
    return order


def add_ratios(rows, repeat=1):
    """Fill vs_best_peer, best_peer and vs_single of every row from the reported rows (:func:`current`)."""
    last = current(rows, repeat)
    best, single = {}, {}
    for r in last.values():
        v = _num(r.get("img_per_sec"))
        if r.get("status") != "ok" or v is None:
            continue
        g = (r["model"], r["network"], str(r["np"]))
        if is_peer(r["method"]) and v > best.get(g, (0, ""))[0]:
            best[g] = (v, r["method"])
        if r["method"] == "single":
            single[(r["model"], str(r["np"]))] = v
    for r in rows:
        v = _num(r.get("img_per_sec"))
        r["vs_best_peer"] = r["best_peer"] = r["vs_single"] = None
        if r.get("status") != "ok" or v is None:
            continue
        b = best.get((r["model"], r["network"], str(r["np"])))
        if b and r["method"] != "single":
            r["vs_best_peer"], r["best_peer"] = v / b[0], b[1]
        s = single.get((r["model"], str(r["np"])))
        if s:
            r["vs_single"] = v / s
    return rows


def _ratio(v):
    v = _num(v)
    return "-" if v is None else f"{v:.2f}x"


def describe(r):
    if r.get("status") != "ok":
        return f"{r['status'].upper()}: {r.get('error', '')}"
    v, c = _num(r["img_per_sec"]), _num(r.get("conf")) or 0.0
    tot = _num(r.get("total_img_per_sec")) or 0.0
    parts = [f"{v:.1f} +- {c:.1f} img/sec per rank, {tot:.1f} total on {r['procs']}"]
    if _num(r.get("vs_best_peer")) is not None:
        parts.append(f"{_ratio(r['vs_best_peer'])} best peer ({r['best_peer']})")
    if _num(r.get("vs_single")) is not None:
        parts.append(f"{_ratio(r['vs_single'])} single")
    if _num(r.get("bytes_ratio")) is not None:
        parts.append(f"{_num(r['bytes_ratio']):.2f}x fewer bytes than fp32")
    if r.get("replicas") and r["replicas"] != "one":
        parts.append(f"replicas {r['replicas']}")
    return "; ".join(parts)


def print_table(rows):
    head = ("id", "N", "img/sec/rank", "+-", "total", "vs peer", "vs single", "bytes x", "replicas",
            "status", "s", "runs", "range")
    body = []
    for r in rows:
        ok = r.get("status") == "ok"
        v, c, t = (_num(r.get(k)) for k in ("img_per_sec", "conf", "total_img_per_sec"))
        body.append((r["id"], str(r["np"]), f"{v:.1f}" if ok and v is not None else "-",
                     f"{c:.1f}" if ok and c is not None else "-", f"{t:.1f}" if ok and t is not None else "-",
                     _ratio(r.get("vs_best_peer")), _ratio(r.get("vs_single")),
                     "-" if _num(r.get("bytes_ratio")) is None else f"{_num(r['bytes_ratio']):.2f}",
                     r.get("replicas") or "-", r.get("status", ""),
                     "-" if _num(r.get("seconds")) is None else f"{_num(r['seconds']):.0f}",
                     r.get("runs") or "-",
                     f"{_num(r['low']):.1f}-{_num(r['high']):.1f}" if r.get("runs") else "-"))
    widths = [max(len(x[i]) for x in [head] + body) for i in range(len(head))]
    line = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)  # noqa: E731
                                   for i, (c, w) in enumerate(zip(cells, widths)))
    print(line(head))
    print(line(["-" * w for w in widths]))
    for b in body:
        print(line(b))
    for r in rows:
        if r.get("status") not in ("ok", None):
            print(f"  {r['id']}: {r['status']}: {r.get('error', '')}")


# ---- chart -------------------------------------------------------------------------------------------

def plot(csv_path, png_path=None, repeat=1):
    """Draw ``train.png`` beside ``csv_path``: one panel per model/network (and N), one bar per method
    (per-rank img/sec of the reported row, :func:`current`; single drawn in every panel of its model),
    annotated with vs_best_peer."""
    csv_path = Path(csv_path)
    png_path = Path(png_path) if png_path else csv_path.with_suffix(".png")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"chart skipped: matplotlib is missing; `python -m hvd_quant.bench train --plot {csv_path}` "
              f"redraws it where matplotlib is installed", flush=True)
        return None
    rows = [r for r in add_ratios(list(current(read_rows(csv_path), repeat).values()), repeat)
            if r.get("status") == "ok"]
    groups = {}
    for r in rows:
        if r["method"] != "single":
            groups.setdefault((r["model"], r["network"], str(r["np"])), []).append(r)
    singles = {(r["model"], str(r["np"])): r for r in rows if r["method"] == "single"}
    if not groups and not singles:
        print(f"chart skipped: no ok rows in {csv_path}", flush=True)
        return None
    if not groups:
        groups = {(m, "local", n): [] for (m, n) in singles}
    keys = sorted(groups)
    width = max(8, 0.8 * max(len(g) + 1 for g in groups.values()) + 2)
    fig, axes = plt.subplots(len(keys), 1, figsize=(width, 3.6 * len(keys)), squeeze=False)
    for ax, k in zip(axes[:, 0], keys):
        bars = ([singles[(k[0], k[2])]] if (k[0], k[2]) in singles else []) + groups[k]
        names = [b["method"] for b in bars]
        vals = [_num(b["img_per_sec"]) for b in bars]
        errs = [_num(b.get("conf")) or 0.0 for b in bars]
        colors = ["0.6" if n == "single" else "tab:blue" if is_peer(n) else
                  "tab:orange" if n.startswith("stock-") else "tab:green" for n in names]
        low = [min(e, v) for e, v in zip(errs, vals)]           # no error bar below zero
        ax.bar(range(len(bars)), vals, yerr=[low, errs], color=colors, capsize=3)
        for i, b in enumerate(bars):
            note = _ratio(b.get("vs_best_peer")) if b["method"] != "single" else "limit"
            ax.annotate(note, (i, vals[i] + errs[i]), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_xticks(range(len(bars)))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("img/sec per rank")
        ax.set_title(f"{k[0]} / {k[1]} / N={k[2]}  (labels: vs best of ddp-*, hvd-*)", fontsize=10)
        ax.set_ylim(0, 1.15 * max([v + e for v, e in zip(vals, errs)] + [1e-9]))
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    print(f"chart: {png_path}", flush=True)
    return png_path


# ---- main --------------------------------------------------------------------------------------------

def resolve(args):
    if args.device == "auto":
        try:
            import torch
            args.device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            args.device = "cpu"
    if args.np is None:
        n = 0
        if args.device == "cuda":
            import torch
            n = torch.cuda.device_count()
        args.np = n if n >= 1 else 2
    if args.np < 1:
        raise SystemExit("--np must be >= 1")
    if args.force_exchange and args.np != 1:
        raise SystemExit("--force-exchange needs --np 1")
    d = GPU_DEFAULTS if args.device == "cuda" else CPU_DEFAULTS
    for k, v in d.items():
        if getattr(args, k, None) is None:
            setattr(args, k, v)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.np)
    return args


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.repeat < 1:
        raise SystemExit("--repeat must be >= 1")
    if args.plot:
        plot(args.plot, repeat=args.repeat)
        return 0
    args = resolve(args)
    configs = plan(args)
    out_dir = Path(args.out)
    csv_path = out_dir / "train.csv"
    have = {}
    for r in read_rows(csv_path):
        if r.get("status") == "ok":
            k = (r["id"], str(r["np"]))
            have[k] = have.get(k, 0) + 1
    need = {c.key: args.repeat if args.fresh else max(0, args.repeat - have.get(c.key, 0)) for c in configs}
    todo = [c for c in configs if need[c.key]]
    if args.list:
        try:
            for c in configs:
                mark = "run " if c in todo else "done"
                note = "" if c.spec is not None else f"  (invalid: {c.error})"
                print(f"{mark}  {c.id}  N={c.np}{note}", flush=True)
        except BrokenPipeError:         # `--list | head`
            sys.stdout = open(os.devnull, "w")
        return 0
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"# hvd_quant training benchmark: device {args.device}, N={args.np}"
          f"{' (exchange forced at size 1)' if args.force_exchange else ''}, "
          f"batch {args.batch_size} per rank, {args.image_size} px, warm-up {args.num_warmup_batches}, "
          f"{args.num_iters} x {args.num_batches_per_iter} batches"
          f"{f', {args.repeat} runs of each config' if args.repeat > 1 else ''}"
          f"{f', {args.threads} thread(s) per process' if args.device == 'cpu' else ''}; "
          f"{len(configs)} configs, {len(configs) - len(todo)} already ok in {csv_path}", flush=True)
    for c in configs:
        if c not in todo:
            print(f"skip {c.id} (ok in {csv_path}; --fresh runs it again)", flush=True)
    t_start = time.monotonic()
    order, failed = run_order(todo, need), 0
    for i, cfg in enumerate(order, 1):
        row = run_job(cfg, args, out_dir, i, len(order))
        failed += row.get("status") != "ok"
        row["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S")
        rows = read_rows(csv_path) + [row]
        add_ratios(rows, args.repeat)
        append_row(csv_path, rows[-1])
        print(f"done {cfg.id}: {describe(rows[-1])}  [{row.get('seconds', 0):.0f} s, "
              f"{time.monotonic() - t_start:.0f} s in all]", flush=True)
    rows = add_ratios(read_rows(csv_path), args.repeat)
    if rows:
        write_rows(csv_path, rows)
    last = current(rows, args.repeat)
    mine = [last[c.key] for c in configs if c.key in last]
    print()
    print_table(mine)
    print(f"\nCSV: {csv_path}")
    if not args.no_plot and rows:
        plot(csv_path, repeat=args.repeat)
    return 0 if not failed and all(r.get("status") == "ok" for r in mine) else 1


if __name__ == "__main__":
    sys.exit(main())
