"""Run the experiment matrices in ``horovodrun_configs/experiments/*.yaml`` (or print their commands).

    python -m examples.sweep --dry-run                       # every command of every matrix
    python examples/sweep.py horovodrun_configs/experiments/qnccl.yaml --only model=resnet20 --dry-run
    python examples/sweep.py --only experiment=mnist-resnet18 --max-gpus 2 --out-dir runs/mnist
    python examples/sweep.py --summarize --out-dir runs/mnist   # table of ours beside the published
    python examples/sweep.py horovodrun_configs/experiments/accuracy.yaml --plot --out-dir runs/accuracy

A matrix file (schema in docs/EXAMPLES.md) has ``launch`` (script, controller, horovod_config,
reduction), optional named ``precisions`` and a list of ``experiments``. An experiment expands to runs
either as a matrix (``precisions`` x ``gpus``) or from an explicit ``runs`` list (each run may name a
``precision``, give its own ``compression``, or inherit the experiment's ``precisions`` list). Every
run becomes one ``horovodrun`` command that passes the tuning YAML with ``--config-file``; real runs
write ``<out-dir>/<run>.log`` and ``<run>.jsonl`` (the driver's ``--metrics-out``) and, at the end,
``<out-dir>/summary.csv`` with our numbers beside the reference ones; with ``--plot``, also the
accuracy table over seeds and the figures (:mod:`examples.common.results`). An experiment (or the
matrix) may list ``seeds``: each run is then made once per seed (``--seed``, run ids ending
``.s<seed>``); ``--seeds`` overrides them and ``--resume`` skips runs already finished. A compressed
run on one rank is skipped (there is nothing to exchange), as are experiments marked
``runnable: false``.
"""
import argparse
import csv
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from examples.common import results  # noqa: E402
from examples.common.cli import parse_spec  # noqa: E402
from examples.common.runlog import parse_log, read_metrics  # noqa: E402

CONFIG_DIR = ROOT / "horovodrun_configs" / "experiments"
NEEDS_DATA = "needs its data files: --data {}=DIR"   # skip reason of a needs_data experiment
# Experiment keys passed to the driver as --flags (value None: left to the driver's default).
DRIVER_KEYS = ("task", "model", "batch_size", "epochs", "max_steps")


@dataclass
class Run:
    run_id: str
    matrix: str
    experiment: str
    model: str
    dataset: str
    task: Optional[str]
    precision: str
    compression: str
    bits: Optional[int]
    bucket: Optional[int]
    mode: Optional[str]
    gpus: int
    nodes: int
    batch_size: Optional[int]
    epochs: Optional[int]
    max_steps: Optional[int]
    reference: Dict = field(default_factory=dict)
    launch: Dict = field(default_factory=dict)
    args: Dict = field(default_factory=dict)
    skip: Optional[str] = None
    seed: Optional[int] = None
    key: str = ""              # the precision's key in the matrix (``32bit``, ``qsgd4``, ...)
    baseline: Optional[str] = None     # the precision key accuracy is compared with
    target: Optional[float] = None     # the largest allowed drop below the baseline, in points
    needs_data: bool = False           # runs only with --data <dataset>=DIR (no offline stand-in)

    def fields(self):
        return {"matrix": self.matrix, "experiment": self.experiment, "model": self.model,
                "dataset": self.dataset, "precision": self.precision, "compression": self.compression,
                "bits": self.bits, "bucket": self.bucket, "mode": self.mode, "gpus": self.gpus,
                "nodes": self.nodes, "batch_size": self.batch_size, "seed": self.seed, "run": self.run_id}


# ----------------------------------------------------------------------------- expansion

def load_matrix(path):
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for key in ("name", "launch", "experiments"):
        if key not in cfg:
            raise ValueError(f"{path}: missing top-level key {key!r}")
    return cfg


def _precision(cfg, name_or_run):
    """A precision dict from a name in ``precisions`` or from a run's own keys."""
    if isinstance(name_or_run, str):
        try:
            p = dict(cfg["precisions"][name_or_run])
        except KeyError:
            raise ValueError(f"{cfg['name']}: unknown precision {name_or_run!r}")
        p.setdefault("name", name_or_run)
        return p
    run = name_or_run
    if "precision" in run:
        return _precision(cfg, run["precision"])
    spec = run.get("compression", "none")
    label = run.get("backend") or spec
    method, params = parse_spec(spec)
    name = "32bit" if method in ("none", "fp32") else "-".join(
        str(x) for x in (f"{method}{params.get('bits', '')}", params.get("mode"),
                         f"b{params['bucket_size']}" if "bucket_size" in params else None) if x)
    return {"name": name, "label": label, "compression": spec, "bits": run.get("bits"),
            "bucket": run.get("bucket"), "mode": run.get("mode")}


def _reference_for(exp, prec_name, gpus, run_ref, ref_precision):
    """The published numbers that sit beside one run."""
    if run_ref is not None:
        return run_ref if (ref_precision is None or prec_name == ref_precision) else {}
    ref = exp.get("reference") or {}
    row = ref.get(prec_name)
    if not row:
        return {}
    out = {}
    sps = row.get("samples_per_sec") or {}
    if gpus in sps:
        out["samples_per_sec"] = sps[gpus]
    if "accuracy" in row:
        out["accuracy"] = dict(zip(ref.get("accuracy_at_epochs", []), row["accuracy"]))
    return out


def expand(cfg, seeds=None):
    """Every :class:`Run` of a matrix file (``seeds``: instead of the matrix's own)."""
    runs = []
    mname = cfg["name"]
    for exp in cfg["experiments"]:
        base = dict(model=exp["model"], dataset=exp["dataset"], task=exp.get("task"),
                    batch_size=exp.get("batch_size"), epochs=exp.get("epochs"),
                    max_steps=exp.get("max_steps"))
        skip = None if exp.get("runnable", True) else f"not runnable: {exp.get('why_not', 'no definition')}"
        items = []  # (precision dict, gpus, nodes, overrides, run reference or None)
        if "runs" in exp:
            for r in exp["runs"]:
                overrides = {k: r[k] for k in ("batch_size", "epochs", "max_steps") if k in r}
                if "precision" in r or "compression" in r:
                    items.append((_precision(cfg, r), r["gpus"], r.get("nodes", 1), overrides,
                                  r.get("reference", {}), None, r.get("notes")))
                else:
                    for pname in exp.get("precisions", ["32bit"]):
                        items.append((_precision(cfg, pname), r["gpus"], r.get("nodes", 1), overrides,
                                      r.get("reference", {}), exp.get("reference_precision"), r.get("notes")))
        else:
            for pname in exp["precisions"]:
                for g in exp["gpus"]:
                    items.append((_precision(cfg, pname), g, exp.get("nodes", 1), {}, None, None, None))
        seen = {}
        for (prec, gpus, nodes, overrides, run_ref, ref_prec, notes), seed in (
                (item, seed) for item in items
                for seed in (seeds or exp.get("seeds", cfg.get("seeds")) or [None])):
            fields = dict(base, **overrides)
            ref = _reference_for(exp, prec["name"], gpus, run_ref, ref_prec)
            if notes:
                ref = dict(ref, notes=notes)
            rid = f"{mname}.{exp['id']}.{prec['name']}.{gpus}g"
            if nodes > 1:
                rid += f"{nodes}n"
            if seed is not None:
                rid += f".s{seed}"
            seen[rid] = seen.get(rid, 0) + 1
            if seen[rid] > 1:
                rid += f".v{seen[rid]}"
            rskip = skip
            if rskip is None and exp.get("needs_data"):
                rskip = NEEDS_DATA.format(fields["dataset"])
            if rskip is None and gpus == 1 and prec.get("compression", "none") not in ("none", "fp32"):
                rskip = "compressed run on 1 rank: nothing to exchange"
            runs.append(Run(rid, mname, exp["id"], fields["model"], fields["dataset"], fields["task"],
                            prec.get("label", prec["name"]), prec.get("compression", "none"),
                            prec.get("bits"), prec.get("bucket"), prec.get("mode"), int(gpus), int(nodes),
                            fields.get("batch_size"), fields.get("epochs"), fields.get("max_steps"),
                            ref, cfg["launch"], dict(exp.get("args") or {}, **prec.get("args", {})),
                            rskip, seed, prec["name"],
                            cfg.get("baseline", "32bit"), (cfg.get("targets") or {}).get(prec["name"]),
                            bool(exp.get("needs_data"))))
    return runs


# ----------------------------------------------------------------------------- commands

def _flag(key):
    return "--" + key.replace("_", "-")


def command(run: Run, opts) -> List[str]:
    launch = run.launch
    controller = opts.controller or launch.get("controller", "gloo")
    hosts = opts.hosts or f"localhost:{run.gpus}"
    if opts.slownet:
        # one network namespace per rank, Gloo over rate-limited links (scripts/slownet.py, root);
        # slownet starts the ranks itself, so horovodrun's flags and tuning file do not apply
        cmd = [opts.python, str(ROOT / "scripts" / "slownet.py"), "--np", str(run.gpus),
               "--rate", opts.slownet, "--"]
    else:
        cmd = [opts.horovodrun, "-np", str(run.gpus), "-H", hosts, f"--{controller}"]
        if launch.get("horovod_config"):
            cmd += ["--config-file", launch["horovod_config"]]
        if opts.timeline:
            cmd += ["--timeline-filename", str(Path(opts.out_dir) / f"{run.run_id}.timeline.json")]
    cmd += [opts.python, launch.get("script", "examples/pytorch/train.py")]
    for key in DRIVER_KEYS:
        value = getattr(run, key)
        if value is not None:
            cmd += [_flag(key), str(value)]
    cmd += ["--compression", run.compression, "--reduction", launch.get("reduction", "sra")]
    if run.seed is not None:
        cmd += ["--seed", str(run.seed)]
    for key, value in run.args.items():
        if value is True:
            cmd.append(_flag(key))
        elif value not in (None, False):
            cmd += [_flag(key), str(value)]
    data_dir = opts.data.get(run.dataset)
    if data_dir:
        cmd += ["--data-dir", data_dir]
    cmd += ["--metrics-out", str(Path(opts.out_dir) / f"{run.run_id}.jsonl"), "--no-progress"]
    cmd += shlex.split(opts.extra_args or "")
    return cmd


def matches(run: Run, filters) -> bool:
    f = run.fields()
    for key, want in filters:
        have = f.get(key)
        if have is None or str(have) not in want.split("|"):
            return False
    return True


# ----------------------------------------------------------------------------- running and summary

def ours_from(run: Run, out_dir: Path) -> Dict:
    """Our numbers for a finished run, from its metrics file (else its log)."""
    out = {}
    mpath = out_dir / f"{run.run_id}.jsonl"
    if mpath.exists():
        recs = read_metrics(str(mpath))
        for r in recs:
            if r.get("event") == "summary":
                out["data_per_sec"] = r.get("bench_data_per_sec")
                out["bytes_sent_per_step"] = r.get("bytes_sent_per_step")
                out["bytes_fp32_per_step"] = r.get("bytes_fp32_per_step")
            elif r.get("event") == "epoch" and r.get("test_accuracy") is not None:
                out.setdefault("test_accuracy", []).append(round(r["test_accuracy"], 5))
            elif r.get("event") == "config" and "data" in r:
                out["data"] = r["data"]
    lpath = out_dir / f"{run.run_id}.log"
    if "data_per_sec" not in out and lpath.exists():
        for entry in parse_log(lpath.read_text(errors="replace")).values():
            if entry["throughput"] is not None:
                out["data_per_sec"] = entry["throughput"]
    return out


def write_summary(runs, out_dir: Path):
    rows = []
    for run in runs:
        ours = ours_from(run, out_dir)
        if not ours:
            continue
        rows.append(dict(run.fields(), ours=json.dumps(ours), reference=json.dumps(run.reference)))
    if not rows:
        print(f"no finished runs under {out_dir}")
        return None
    path = out_dir / "summary.csv"
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(f"{r['run']}: ours {r['ours']}  published {r['reference']}")
    print(f"summary: {path}")
    return path


def execute(run: Run, cmd, opts) -> int:
    out_dir = Path(opts.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("PYTHONUNBUFFERED", "1")
    log_path = out_dir / f"{run.run_id}.log"
    t0 = time.time()
    with open(log_path, "w") as log:
        log.write("# " + shlex.join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env,
                                timeout=opts.timeout or None).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    print(f"[{'ok' if rc == 0 else f'rc={rc}'}] {run.run_id} in {time.time() - t0:.1f}s -> {log_path}",
          flush=True)
    return rc


def _tool(name):
    here = Path(sys.executable).parent / name
    return str(here) if here.exists() else (shutil.which(name) or name)


def build_parser():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("configs", nargs="*", help="matrix YAML files (default: horovodrun_configs/experiments/*.yaml)")
    p.add_argument("--dry-run", action="store_true", help="print the launch commands, run nothing")
    p.add_argument("--summarize", action="store_true", help="only rebuild <out-dir>/summary.csv")
    p.add_argument("--plot", action="store_true",
                   help="after the runs (or alone, with --summarize) write <out-dir>/accuracy.md and .csv "
                        "(final test accuracy over seeds against the baseline) and the PNG figures under "
                        "<out-dir>/figures (examples/common/results.py)")
    p.add_argument("--seeds", default=None, metavar="S1,S2,...",
                   help="run each run once per seed given here instead of the matrix's seeds")
    p.add_argument("--resume", action="store_true",
                   help="skip runs whose metrics file under --out-dir already holds a finished summary")
    p.add_argument("--note", default="", help="a line for the figures' titles (the machine, say)")
    p.add_argument("--only", action="append", default=[], metavar="KEY=V1|V2",
                   help="keep runs whose KEY (matrix, experiment, model, dataset, precision, compression, "
                        "bits, bucket, mode, gpus, nodes, run) is one of the values; repeatable")
    p.add_argument("--max-gpus", type=int, default=0, help="skip runs needing more processes")
    p.add_argument("--controller", choices=("gloo", "mpi"), default=None, help="override the matrix's")
    p.add_argument("--hosts", default=None, help="horovodrun -H value (default localhost:<gpus>)")
    p.add_argument("--data", action="append", default=[], metavar="DATASET=DIR",
                   help="pass --data-dir DIR to runs of DATASET (mnist, cifar10, sst5); repeatable")
    p.add_argument("--extra-args", default="", help="appended to every driver command (e.g. tiny sizes)")
    p.add_argument("--timeline", action="store_true", help="write a Horovod timeline per run")
    p.add_argument("--slownet", default=None, metavar="RATE",
                   help="run each job through scripts/slownet.py at this link rate (e.g. 1gbit): one "
                        "network namespace per rank on this machine, Gloo between them (needs root); "
                        "the tuning YAML and --hosts/--controller/--timeline do not apply")
    p.add_argument("--out-dir", default="runs/sweep")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--horovodrun", default=_tool("horovodrun"))
    p.add_argument("--timeout", type=float, default=0, help="seconds per run (0: none)")
    return p


def main(argv=None):
    opts = build_parser().parse_args(argv)
    opts.data = dict(item.split("=", 1) for item in opts.data)
    filters = []
    for item in opts.only:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--only expects KEY=VALUE, got {item!r}")
        filters.append((key.strip(), value.strip()))
    try:
        seeds = [int(x) for x in opts.seeds.split(",")] if opts.seeds else None
    except ValueError:
        raise SystemExit(f"--seeds expects comma-separated integers, got {opts.seeds!r}")
    paths = opts.configs or sorted(glob.glob(str(CONFIG_DIR / "*.yaml")))
    if not paths:
        raise SystemExit(f"no matrix files under {CONFIG_DIR}")
    runs = []
    for path in paths:
        runs += expand(load_matrix(path), seeds)
    runs = [r for r in runs if matches(r, filters)]
    for r in runs:
        if r.needs_data and r.dataset in opts.data and r.skip == NEEDS_DATA.format(r.dataset):
            r.skip = None
    if opts.max_gpus:
        for r in runs:
            if r.skip is None and r.gpus > opts.max_gpus:
                r.skip = f"needs {r.gpus} processes > --max-gpus {opts.max_gpus}"
    if opts.summarize:
        write_summary(runs, Path(opts.out_dir))
        if opts.plot:
            results.report(runs, opts.out_dir, opts.note)
        return 0
    todo = [r for r in runs if r.skip is None]
    print(f"# {len(runs)} runs from {len(paths)} matrix file(s): {len(todo)} to launch, "
          f"{len(runs) - len(todo)} skipped", flush=True)
    failures = 0
    for run in runs:
        ref = json.dumps(run.reference, separators=(",", ":")) if run.reference else "-"
        head = (f"# {run.run_id}: {run.model} on {run.dataset}, {run.precision}, {run.gpus} GPU(s)"
                f"{f' on {run.nodes} nodes' if run.nodes > 1 else ''}; published: {ref}")
        if run.skip:
            print(f"{head}\n# skipped: {run.skip}")
            continue
        cmd = command(run, opts)
        if opts.resume and results.load(Path(opts.out_dir) / f"{run.run_id}.jsonl") is not None:
            print(f"{head}\n# finished before (--resume): {run.run_id}.jsonl")
            continue
        if run.nodes > 1 and not opts.hosts:
            head += f"\n# {run.nodes} nodes: give --hosts (e.g. host1:2,host2:2); shown on localhost"
        print(f"{head}\n{shlex.join(cmd)}", flush=True)
        if not opts.dry_run:
            failures += execute(run, cmd, opts) != 0
    if not opts.dry_run and todo:
        write_summary(runs, Path(opts.out_dir))
        if opts.plot:
            results.report(runs, opts.out_dir, opts.note)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # e.g. piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
