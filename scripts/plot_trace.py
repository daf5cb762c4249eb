"""Where one training step's time goes, from the traces of ``python -m hvd_quant.bench train --trace``.

    python scripts/plot_trace.py DIR/traces/<id>.rank0.json.gz [--step -1] [--out step.png] [--responses 90]

Reads one rank's Chrome trace (torch.profiler) and one traced step (``train_step#i``; default the last),
prints the step's wall time, the busy time of each GPU stream split into compute, NCCL and hvd_quant
(Numba) kernels and copies, the time no kernel ran on the GPU, the host's top-level work on each
thread, and, where the Horovod timeline of the same job lies beside it (``<id>.horovod.json``), the time
of each of Horovod's activities over the traced steps (with ``--responses MS``, also each activity
of the timeline's last MS milliseconds, per tensor: which collectives Horovod fused, and what each
waited for); with ``--launches``, each hvd_quant, NCCL and Horovod kernel of the step with the time
the host launched it and the time it ran (how far behind the host the GPU was); with ``--out``, a PNG
of the step's timeline (one lane per host thread and GPU stream).
"""
import argparse
import gzip
import json
import os
import re
from collections import defaultdict

COLORS = {"nccl": "tab:red", "hvd_quant": "tab:green", "copy": "tab:purple", "compute": "tab:blue",
          "step": "tab:orange", "backward": "tab:cyan", "host": "tab:gray"}


def kernel_class(e):
    name = e["name"]
    if e.get("cat") in ("gpu_memcpy", "gpu_memset"):
        return "copy"
    if "nccl" in name.lower():
        return "nccl"
    if "cudapy" in name or "numba" in name:     # Numba's kernels: hvd_quant's codec
        return "hvd_quant"
    return "compute"


def host_class(e):
    name = e["name"]
    if name.startswith("Optimizer.step") or name.startswith("Optimizer.zero_grad"):
        return "step"
    if name.startswith("autograd::") or "Backward" in name:
        return "backward"
    return "host"


def union(intervals):
    total, end = 0.0, None
    for a, b in sorted(intervals):
        if end is None or a > end:
            total += b - a
            end = b
        elif b > end:
            total += b - end
            end = b
    return total


def top_level(events):
    """The events not nested inside another one of the same list (one host thread)."""
    out, end = [], -1.0
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def load_step(path, which):
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = sorted((e for e in events if re.fullmatch(r"train_step#\d+", str(e["name"]))
                    and e.get("cat") == "user_annotation"),
                   key=lambda e: e["ts"])
    if not steps:
        raise SystemExit(f"{path}: no train_step#i ranges (a trace of bench train --trace?)")
    s = steps[which]
    t0, t1 = s["ts"], s["ts"] + s["dur"]
    inside = [e for e in events if e is not s and e["ts"] < t1 and e["ts"] + e["dur"] > t0
              and not str(e["name"]).startswith("train_step#")]
    return s, inside, events


def launches(gpu, events, t0):
    """Lines: each hvd_quant, NCCL or Horovod kernel of ``gpu``, with its host launch (the CUDA
    runtime or driver call of the same correlation id) and its start on the GPU, ms from ``t0``."""
    host = {e["args"]["correlation"]: e for e in events
            if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    out = []
    for e in sorted(gpu, key=lambda e: e["ts"]):
        kind = "horovod" if "horovod" in e["name"] else kernel_class(e)
        if kind in ("nccl", "hvd_quant", "horovod"):
            h = host.get(e.get("args", {}).get("correlation"))
            at = f"{(h['ts'] - t0) / 1e3:8.2f}" if h else "       ?"
            out.append(f"  {at} -> {(e['ts'] - t0) / 1e3:8.2f} {e['dur'] / 1e3:8.2f}  {kind:9s} {e['name'][:70]}")
    return out


def horovod_activities(path):
    """Every activity of a Horovod timeline: (start µs, duration µs, activity, tensor, nesting depth),
    in start order (B/E pairs per tensor)."""
    with open(path) as f:
        text = f.read().rstrip().rstrip(",")
    events = json.loads(text if text.endswith("]") else text + "]")
    tensors = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name" and "name" in e.get("args", {})}
    open_, out = {}, []
    for e in events:
        if e.get("ph") == "B":
            open_.setdefault(e["pid"], []).append(e)
        elif e.get("ph") == "E" and open_.get(e["pid"]):
            b = open_[e["pid"]].pop()
            out.append((b["ts"], e["ts"] - b["ts"], b["name"], tensors.get(e["pid"], e["pid"]),
                        len(open_[e["pid"]])))
    return sorted(out)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace")
    p.add_argument("--step", type=int, default=-1, help="which traced step (index; default the last)")
    p.add_argument("--out", default=None, help="write the step's timeline as this PNG")
    p.add_argument("--responses", type=float, default=0, metavar="MS",
                   help="also list each Horovod activity, per tensor, of the timeline's last MS ms")
    p.add_argument("--launches", action="store_true",
                   help="also list the step's hvd_quant, NCCL and Horovod kernels: host launch -> GPU start")
    args = p.parse_args(argv)
    s, inside, events = load_step(args.trace, args.step)
    t0, wall = s["ts"], s["dur"]
    gpu = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    host = [e for e in inside if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]
    clip = [(max(e["ts"], t0), min(e["ts"] + e["dur"], t0 + wall)) for e in gpu]
    print(f"{s['name']}: {wall / 1e3:.2f} ms wall")
    raw = defaultdict(list)
    for e in gpu:
        raw[("GPU", e["pid"], e["tid"])].append(e)
    for e in host:
        raw[("host", e["pid"], e["tid"])].append(e)
    # each lane's events with their class: every kernel of a GPU stream, a host thread's top level
    lanes = {key: [(kernel_class(e), e) for e in evs] if key[0] == "GPU"
             else [(host_class(e), e) for e in top_level(evs)] for key, evs in raw.items()}
    if gpu:
        print(f"  GPU idle (no kernel or copy on any stream): {(wall - union(clip)) / 1e3:.2f} ms")
    for key in sorted(lanes, key=str):
        by = defaultdict(float)
        for c, e in lanes[key]:
            by[c] += e["dur"]
        parts = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(by.items(), key=lambda kv: -kv[1]))
        print(f"  {key[0]} {key[1]}/{key[2]}: {parts} (ms)")
    if args.launches:
        print("hvd_quant, NCCL and Horovod kernels: host launch -> GPU start, duration (ms from the step's start)")
        print("\n".join(launches(gpu, events, t0)))
    hv = args.trace.replace(re.search(r"\.rank\d+\.json(\.gz)?$", args.trace).group(0), ".horovod.json")
    if os.path.exists(hv):
        activities = horovod_activities(hv)
        total = defaultdict(lambda: [0.0, 0])
        for _, dur, name, _, _ in activities:
            total[name][0] += dur
            total[name][1] += 1
        print(f"Horovod timeline of all traced steps ({os.path.basename(hv)}), ms (count):")
        for name, (us, n) in sorted(total.items(), key=lambda kv: -kv[1][0]):
            print(f"  {name:32s} {us / 1e3:9.2f} ({n})")
        if args.responses and activities:
            end = max(ts + dur for ts, dur, *_ in activities)
            start = end - args.responses * 1e3
            print(f"Horovod's activities of the timeline's last {args.responses:g} ms: start, duration (ms)")
            for ts, dur, name, tensor, depth in activities:
                if ts >= start:
                    print(f"  {(ts - start) / 1e3:8.2f} {dur / 1e3:8.2f} {'  ' * depth}{name:28s} {tensor}")
    if args.out:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        keys = sorted(lanes, key=lambda k: (k[0] != "host", str(k)))
        fig, ax = plt.subplots(figsize=(14, 0.5 * len(keys) + 1.5))
        for y, key in enumerate(keys):
            by = defaultdict(list)
            for c, e in lanes[key]:
                by[c].append(((e["ts"] - t0) / 1e3, e["dur"] / 1e3))
            for c, bars in by.items():
                ax.broken_barh(bars, (y - 0.4, 0.8), color=COLORS[c])
        ax.set_yticks(range(len(keys)), [("GPU stream " if k[0] == "GPU" else "host thread ") + str(k[2]) for k in keys])
        ax.set_xlim(0, wall / 1e3)
        ax.set_xlabel("ms from the step's start")
        ax.legend(handles=[matplotlib.patches.Patch(color=v, label=k) for k, v in COLORS.items()],
                  ncol=len(COLORS), loc="upper center", bbox_to_anchor=(0.5, -0.15), fontsize=8)
        ax.set_title(f"{os.path.basename(args.trace)}: {s['name']}, {wall / 1e3:.1f} ms")
        fig.tight_layout()
        fig.savefig(args.out, dpi=110)
        print(f"chart: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
