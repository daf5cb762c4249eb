"""Accuracy per precision on the two real tasks, and the data files the docs' tables are made from.

    python examples/accuracy.py --seeds 1,2,3 --jobs 2 --out-dir runs/accuracy --data-dir docs/data

The grid is ``horovodrun_configs/experiments/accuracy.yaml``: its ``precisions`` (fp32, fp16, QSGD
8/4/2-bit stochastic and deterministic, 1-bit with error feedback, 1-bit Adam; and on torch DDP under
torchrun, ``frontend: ddp``: DDP fp32, the 4-bit ``hvd_quant.torch.ddp_comm_hook``, DDP's PowerSGD
hook at rank 4) times its experiments (MNIST
5,000-image sample with a quarter-width ResNet-18; the byte-level language model on the Python
standard library's source) times the seeds. Every run is one real Horovod job of 2 ranks over Gloo on
CPU (a ``ddp`` precision: one torchrun job, ``examples/pytorch/train.py --frontend ddp``), exchanging
through ``hvd_quant.torch.DistributedOptimizer`` (fp32 too: its codec is ``none``),
so only the codec differs between the runs of one seed; every task trains with Adam, so ``32bit``
is uncompressed Adam and ``onebit-ef`` plain 1-bit EF under Adam; ``onebit-adam`` runs
``hvd_quant.torch.OneBitAdam`` instead (a precision's ``args`` are added to the driver's); ``--jobs`` runs that many jobs at once
(``--threads`` CPU threads per rank). A seed fixes the initialisation and the data order; MNIST's
train/test split is fixed whatever the seed.

Written after every finished run (so an interrupted grid keeps what it measured):

- ``<data-dir>/accuracy_<task>.json``: the table, one row per precision: the final validation loss
  (mean and sample s.d. over seeds), the paired difference to fp32 (per seed, then mean and s.d.),
  for MNIST the test accuracy with its standard error over the 1,000 test images, the target and
  whether it was met; with the command, commit, machine, versions and date;
- ``<data-dir>/accuracy_<task>_raw.csv``: one line per run.

Targets (the experiment's ``targets``): MNIST, accuracy at most 0.5 points below fp32's (mean of the
paired differences); language model, final validation loss at most 1% above fp32's (1-bit Adam: 2%).
"""
import argparse
import csv
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if __package__ in (None, ""):
    sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from examples.common.runlog import read_metrics  # noqa: E402

MATRIX = ROOT / "horovodrun_configs" / "experiments" / "accuracy.yaml"
TRAIN = "examples/pytorch/train.py"
RAW_FIELDS = ["task", "experiment", "precision", "compression", "seed", "status", "final_val_loss",
              "test_accuracy", "test_count", "steps", "train_time_s", "bytes_sent_per_step",
              "bytes_fp32_per_step", "wall_s", "log"]


def load(path=MATRIX):
    with open(path) as f:
        return yaml.safe_load(f)


def grid(cfg, seeds, tasks=None, precisions=None):
    """``[(experiment, precision key, seed)]``: the fp32, 8-bit and 4-bit runs of every seed first (the
    ones with targets), then the rest, so a grid cut short still holds its comparisons."""
    first = [cfg["baseline"]] + [k for k in cfg["precisions"] if k in cfg["experiments"][0]["targets"]]
    keys = first + [k for k in cfg["precisions"] if k not in first]
    out = []
    for key in keys:
        if precisions and key not in precisions:
            continue
        for seed in seeds:
            for exp in cfg["experiments"]:
                if not exp.get("needs_data") and (not tasks or exp["task"] in tasks):
                    out.append((exp, key, seed))
    return out


def command(cfg, exp, key, seed, threads, metrics):
    """The command of one run: horovodrun, or torchrun for a precision whose ``frontend`` is ``ddp``."""
    prec = cfg["precisions"][key]
    launch = {**cfg["launch"], **prec.get("launch", {})}     # a precision's own ranks, nodes, reduction
    frontend = prec.get("frontend", "hvd_quant")
    if frontend == "ddp":       # a free port of its own (--standalone): runs at once do not collide
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                str(launch["ranks"])]
    else:
        # nodes > 1: emulated nodes, two names of this machine that Horovod takes for two hosts
        nodes, ranks, names = launch.get("nodes", 1), launch["ranks"], ("localhost", "127.0.0.1")
        if nodes > len(names) or ranks % nodes:
            raise ValueError(f"{key}: launch nodes={nodes} for {ranks} ranks; emulated nodes are at most "
                             f"{len(names)} of equal size")
        hosts = ",".join(f"{h}:{ranks // nodes}" for h in names[:nodes])
        argv = [sys.executable, "-m", "horovod.runner.launch", "-np", str(ranks), "-H",
                hosts, f"--{launch['controller']}", "--config-file",
                launch["horovod_config"], sys.executable]
    argv += [TRAIN, "--task", exp["task"], "--model", exp["model"],
             "--compression", prec["compression"], "--frontend", frontend, "--reduction", launch["reduction"],
             "--seed", str(seed), "--threads", str(threads), "--no-progress", "--metrics-out", str(metrics),
             "--batch-size", str(exp["batch_size"]), "--epochs", str(exp["epochs"]),
             "--max-steps", str(exp["max_steps"])]
    for k, v in {**exp.get("args", {}), **prec.get("args", {})}.items():   # a precision's own win
        flag = f"--{k.replace('_', '-')}"
        argv += [flag] if v is True else [flag, str(v)]
    return argv


def result(metrics):
    """The numbers of one finished run from its metrics file."""
    recs = read_metrics(str(metrics))
    epochs = [r for r in recs if r["event"] == "epoch"]
    summary = [r for r in recs if r["event"] == "summary"]
    if not epochs or not summary:
        raise ValueError(f"{metrics}: no epoch or summary record")
    last, s = epochs[-1], summary[-1]
    return dict(final_val_loss=last["test_loss"], test_accuracy=last["test_accuracy"],
                test_count=last["test_count"], steps=s["steps"],
                train_time_s=round(s["train_time"], 2), bytes_sent_per_step=s["bytes_sent_per_step"],
                bytes_fp32_per_step=s["bytes_fp32_per_step"])


def _mean_sd(values):
    values = [v for v in values if v is not None]
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def _pm(mean, sd, fmt):
    if mean is None:
        return "n/a"
    return fmt.format(mean) + ("" if sd is None else " ± " + fmt.replace("+", "").format(sd))


def table(cfg, exp, raw):
    """``(columns, rows, per-precision summary)`` of one experiment from its raw records."""
    mine = [r for r in raw if r["experiment"] == exp["id"] and r["status"] == "ok"]
    # a precision's baseline: its own ``baseline`` key (DDP's rows: DDP fp32), else the matrix's
    base_of = {key: prec.get("baseline", cfg["baseline"]) for key, prec in cfg["precisions"].items()}
    bases = {b: {r["seed"]: r for r in mine if r["precision"] == b} for b in set(base_of.values())}
    targets = exp["targets"]
    mnist = exp["metric"] == "accuracy"
    if mnist:
        columns = ["method", "codec", "seeds", "final val loss (mean ± s.d.)", "test accuracy % (mean ± s.d.)",
                   "s.e. over test images (points)", "accuracy diff vs fp32, points (paired, mean ± s.d.)",
                   "target", "verdict"]
    else:
        columns = ["method", "codec", "seeds", "final val loss, nats/byte (mean ± s.d.)", "perplexity",
                   "loss diff vs fp32 % (paired, mean ± s.d.)", "target", "verdict"]
    rows, summary = [], {}
    for key, prec in cfg["precisions"].items():
        runs = sorted((r for r in mine if r["precision"] == key), key=lambda r: r["seed"])
        if not runs:
            continue
        loss_m, loss_sd = _mean_sd([r["final_val_loss"] for r in runs])
        base = bases[base_of[key]]
        paired = [r for r in runs if r["seed"] in base]
        if mnist:
            diffs = [100 * (r["test_accuracy"] - base[r["seed"]]["test_accuracy"]) for r in paired]
        else:
            diffs = [100 * (r["final_val_loss"] / base[r["seed"]]["final_val_loss"] - 1) for r in paired]
        is_base = key in bases
        d_m, d_sd = _mean_sd(diffs) if not is_base else (None, None)
        target = targets.get(key)
        verdict = ""
        if target is not None and d_m is not None:
            verdict = "met" if (d_m >= -target if mnist else d_m <= target) else "missed"
        tgt = "" if target is None else (f">= -{target} points" if mnist else f"<= +{target}%")
        cells = [prec["label"], prec["compression"], len(runs), _pm(loss_m, loss_sd, "{:.4f}")]
        if mnist:
            acc_m, acc_sd = _mean_sd([100 * r["test_accuracy"] for r in runs])
            se = 100 * math.sqrt(acc_m / 100 * (1 - acc_m / 100) / runs[0]["test_count"])
            cells += [_pm(acc_m, acc_sd, "{:.2f}"), f"{se:.2f}",
                      "baseline" if is_base else _pm(d_m, d_sd, "{:+.2f}"), tgt, verdict]
        else:
            cells += [f"{math.exp(loss_m):.3f}", "baseline" if is_base else _pm(d_m, d_sd, "{:+.2f}"), tgt, verdict]
        rows.append(cells)
        summary[key] = {"diffs": diffs, "verdict": verdict}
    return columns, rows, summary


def versions():
    out = {"python": platform.python_version()}
    for name in ("torch", "horovod", "numpy", "numba"):
        try:
            out[name] = __import__(name).__version__
        except Exception as e:  # reported, not hidden: the row says which import failed
            out[name] = f"not importable ({type(e).__name__})"
    return out


def write(cfg, raw, data_dir, meta):
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    for exp in cfg["experiments"]:
        mine = [r for r in raw if r["experiment"] == exp["id"]]
        if not mine:
            continue
        name = f"accuracy_{exp['task']}"
        with open(data_dir / f"{name}_raw.csv", "w", newline="") as f:
            w = csv.DictWriter(f, RAW_FIELDS)
            w.writeheader()
            w.writerows(sorted(mine, key=lambda r: (r["precision"], r["seed"])))
        columns, rows, _ = table(cfg, exp, raw)
        failed = [f"{r['precision']} seed {r['seed']}: {r['status']}" for r in mine
                  if r["status"].startswith("failed")]
        doc = {"title": exp["title"], "command": meta["command"], "commit": meta["commit"],
               "machine": meta["machine"], "date": meta["date"], "versions": meta["versions"],
               "columns": columns, "rows": rows,
               "notes": exp["notes"].strip() + (" Runs that did not finish: " + "; ".join(failed) + "."
                                               if failed else "") + meta.get("notes", "")
                        + meta.get("kept", {}).get(exp["task"], ""),
               "raw_file": f"{name}_raw.csv"}
        with open(data_dir / f"{name}.json", "w") as f:
            json.dump(doc, f, indent=1)
            f.write("\n")


_NUMBERS = {"seed": int, "final_val_loss": float, "test_accuracy": float, "test_count": int, "steps": int,
            "train_time_s": float, "bytes_sent_per_step": float, "bytes_fp32_per_step": float, "wall_s": float}


def kept_rows(cfg, data_dir, todo):
    """``--keep``: the rows of the data files already in ``data_dir`` for the runs this call does not
    make (those it makes again become ``superseded``), and per task a note naming where they came from."""
    again = {(exp["id"], key, seed) for exp, key, seed in todo}
    rows, notes = [], {}
    for exp in cfg["experiments"]:
        name = f"accuracy_{exp['task']}"
        raw, doc = Path(data_dir) / f"{name}_raw.csv", Path(data_dir) / f"{name}.json"
        if not raw.is_file():
            continue
        mine = []
        for r in csv.DictReader(open(raw)):
            r = {k: (_NUMBERS[k](v) if k in _NUMBERS and v not in ("", None) else (v or None))
                 for k, v in r.items()}
            again_now = (r["experiment"], r["precision"], r["seed"]) in again
            if again_now and not r["status"].startswith("superseded"):     # ok or failed alike
                r["status"] = "superseded (run again)"
            mine.append(r)
        rows += mine
        old = json.load(open(doc)) if doc.is_file() else {}
        kept = sorted({r["precision"] for r in mine if r["status"] == "ok"})
        notes[exp["task"]] = (f" Kept from the previous data file (commit {old.get('commit', '?')}, command "
                              f"`{old.get('command', '?')}`): the runs of {', '.join(kept)} not run again.")
    return rows, notes


def git_commit():
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--matrix", default=str(MATRIX))
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--tasks", default="", help="comma-separated tasks of the matrix (default: all)")
    keys = "; ".join(f"{k} ({p['label']})" for k, p in load(MATRIX)["precisions"].items())
    ap.add_argument("--precisions", default="", help=f"comma-separated precision keys (default: all): {keys}")
    ap.add_argument("--jobs", type=int, default=1, help="Horovod jobs at once")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    ap.add_argument("--out-dir", default="runs/accuracy", help="logs and metrics of every run")
    ap.add_argument("--data-dir", default="docs/data", help="where the JSON tables and raw CSVs go")
    ap.add_argument("--deadline", type=float, default=0, help="seconds: start no run after this (0: none)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds one run may take")
    ap.add_argument("--commit", default=None, help="the measured code's commit (default: git's HEAD)")
    ap.add_argument("--machine", default=None, help="a line describing the machine (default: from the OS)")
    ap.add_argument("--extra-args", default="", help="appended to every driver command (smoke runs)")
    ap.add_argument("--keep", action="store_true",
                    help="keep the rows of --data-dir's files that this call does not run again (the "
                         "notes name their commit and command); without it the files hold this call's runs")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args(argv)
    cfg = load(args.matrix)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    todo = grid(cfg, seeds, set(filter(None, args.tasks.split(","))), set(filter(None, args.precisions.split(","))))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python examples/accuracy.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:])),
            "commit": args.commit or git_commit(),
            "machine": args.machine or f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores, "
                                       f"{platform.processor() or platform.machine()}; {args.jobs} jobs at once, "
                                       f"{args.threads} thread(s) per rank",
            "date": datetime.date.today().isoformat(), "versions": versions()}
    t0 = time.monotonic()
    pending, running, raw = list(todo), [], []
    if args.keep:
        raw, meta["kept"] = kept_rows(cfg, args.data_dir, todo)
    done0 = len(raw)
    print(f"{len(todo)} runs, {args.jobs} at a time; logs in {out_dir}", flush=True)
    while pending or running:
        while pending and len(running) < args.jobs and not (args.deadline and time.monotonic() - t0 > args.deadline):
            exp, key, seed = pending.pop(0)
            run_id = f"{exp['id']}.{key}.s{seed}"
            metrics = out_dir / f"{run_id}.jsonl"
            cmd = command(cfg, exp, key, seed, args.threads, metrics) + shlex.split(args.extra_args)
            if args.dry_run:
                print(shlex.join(cmd))
                continue
            metrics.unlink(missing_ok=True)
            log = open(out_dir / f"{run_id}.log", "w")
            log.write(shlex.join(cmd) + "\n")
            log.flush()
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            running.append((proc, log, exp, key, seed, run_id, metrics, time.monotonic()))
        if args.deadline and pending and time.monotonic() - t0 > args.deadline and not running:
            print(f"deadline: {len(pending)} runs not started: " + ", ".join(
                f"{e['id']}.{k}.s{s}" for e, k, s in pending), flush=True)
            pending = []
        time.sleep(0.5)
        for item in list(running):
            proc, log, exp, key, seed, run_id, metrics, start = item
            wall = time.monotonic() - start
            if proc.poll() is None and wall < args.timeout:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
            running.remove(item)
            rec = {"task": exp["task"], "experiment": exp["id"], "precision": key,
                   "compression": cfg["precisions"][key]["compression"], "seed": seed, "status": "ok",
                   "wall_s": round(wall, 1), "log": f"{run_id}.log"}
            try:
                if proc.returncode != 0:
                    raise RuntimeError(f"exit {proc.returncode}" if wall < args.timeout else "timeout")
                rec.update(result(metrics))
            except (RuntimeError, ValueError, OSError, KeyError) as e:
                rec["status"] = f"failed ({type(e).__name__}: {e})"
                tail = (out_dir / f"{run_id}.log").read_text(errors="replace").splitlines()[-15:]
                print(f"--- {run_id} failed; the end of its log:\n" + "\n".join(tail), flush=True)
            raw.append(rec)
            done = len(raw) - done0
            print(f"[{done}/{len(todo)} {time.monotonic() - t0:6.0f}s] {run_id}: {rec['status']}"
                  + (f", val loss {rec['final_val_loss']:.4f}, accuracy {rec['test_accuracy']:.4f}"
                     if rec["status"] == "ok" else ""), flush=True)
            write(cfg, raw, args.data_dir, meta)
    if args.dry_run:
        return 0
    for exp in cfg["experiments"]:
        columns, rows, _ = table(cfg, exp, raw)
        if rows:
            print(f"\n{exp['title']}\n| " + " | ".join(columns) + " |")
            for r in rows:
                print("| " + " | ".join(map(str, r)) + " |")
    mine = raw[done0:]
    return 0 if all(r["status"] == "ok" for r in mine) and len(mine) == len(todo) else 1


if __name__ == "__main__":
    sys.exit(main())
