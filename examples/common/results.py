"""What a sweep's finished runs show, over seeds: the accuracy table and the figures.

``examples/sweep.py --plot`` calls :func:`report`; the tests call the pieces. A run's numbers come from
its metrics file (``<out-dir>/<run>.jsonl``, written by :class:`examples.common.runlog.RunLog`):

- the learning curves: test accuracy and test loss after each epoch, train loss at each logged step;
- the summary: data/sec after the warm-up steps, bytes each rank sent per step and fp32's.

Runs of one experiment, GPU count and precision that differ only in their seed form a *group*. The
accuracy table gives each group's final test accuracy as mean, sample standard deviation, min and max
over seeds, and its difference to the matrix's ``baseline`` precision (32bit) in percentage points:
the difference of the means, and the spread of the per-seed differences (a seed gives every precision
the same initialisation, data order and split, so those differences are paired). A ``target`` (the
largest allowed drop, in points) is marked met or missed on the difference of the means.

:func:`curve_gap` is the learning-curve check of the tests: is a precision's mean curve as close to
the baseline's as seed-to-seed noise allows? Each run's curve is reduced to its mean over the epochs
(the area under it). If the precision learned exactly as the baseline does, its n runs are n more
draws from the baseline's distribution, and the gap between the two means over ``n_a`` and ``n_b``
seeds is a Student-t multiple of the baseline's sample spread ``s``: ``|gap| <= t(1 - alpha / (2 m),
n_b - 1) * s * sqrt(1 / n_a + 1 / n_b)``, two-sided, with ``m`` comparisons (Bonferroni) made at once.

Figures (PNG, matplotlib's Agg backend), under ``<out-dir>/figures``:

- ``<matrix>.<experiment>.accuracy.png``: test accuracy per epoch (mean over seeds, min-max band), train
  loss per step (mean) and the final accuracy per precision with its spread;
- ``<matrix>.throughput.png``: data/sec per precision at each GPU count (ours solid, published hatched,
  in the published tables' layout: a panel per experiment, a group per GPU count) and the speedup over
  32bit at the same GPU count beside the published one;
- ``<matrix>.bytes.png``: bytes each rank sends per step, per precision, against fp32's.
"""
import csv
import json
import math
import statistics
from collections import OrderedDict
from pathlib import Path

from .runlog import read_metrics


def load(path):
    """The curves and summary of one run's metrics file, or None when it has no finished model."""
    path = Path(path)
    if not path.exists():
        return None
    out = {"epochs": [], "loss": [], "summary": None}
    for r in read_metrics(str(path)):
        event = r.get("event")
        if event == "epoch" and r.get("test_accuracy") is not None:
            out["epochs"].append((r["epoch"], r["test_accuracy"], r.get("test_loss")))
        elif event == "step" and r.get("loss") is not None:
            out["loss"].append((r["step"], r["loss"]))
        elif event == "summary":
            out["summary"] = r
    return out if out["summary"] is not None else None


def group_runs(runs, out_dir):
    """``{(matrix, experiment, gpus, nodes, key): {"runs": [...], "data": {seed: load(...)}}}`` in the
    matrices' order; runs that did not finish (or were skipped: their published numbers still show in
    the throughput figure) are left out of ``data``."""
    groups = OrderedDict()
    for run in runs:
        g = groups.setdefault((run.matrix, run.experiment, run.gpus, run.nodes, run.key),
                              {"runs": [], "data": OrderedDict()})
        g["runs"].append(run)
        data = load(Path(out_dir) / f"{run.run_id}.jsonl")
        if data is not None:
            g["data"][run.seed] = data
    return groups


def spread(values):
    """``(mean, sample std or None, min, max)`` of a non-empty list."""
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else None
    return mean, std, min(values), max(values)


def final_accuracy(data):
    return data["epochs"][-1][1] if data["epochs"] else None


def final_accuracies(group):
    """``{seed: final test accuracy}`` of a group's finished runs that have one."""
    acc = {s: final_accuracy(d) for s, d in group["data"].items()}
    return {s: a for s, a in acc.items() if a is not None}


def accuracy_rows(groups):
    """One row per group with a test accuracy (module doc)."""
    rows = []
    for (matrix, exp, gpus, nodes, key), g in groups.items():
        acc = final_accuracies(g)
        if not acc:
            continue
        run = g["runs"][0]
        mean, std, lo, hi = spread(list(acc.values()))
        row = OrderedDict(matrix=matrix, experiment=exp, model=run.model, gpus=gpus, precision=key,
                          label=run.precision, compression=run.compression, seeds=len(acc),
                          mean=mean, std=std, min=lo, max=hi, delta_pp=None, delta_std_pp=None,
                          target_pp=run.target, verdict=None)
        base = groups.get((matrix, exp, gpus, nodes, run.baseline)) if run.baseline else None
        if base is not None and run.baseline != key:
            bacc = final_accuracies(base)
            if bacc:
                row["delta_pp"] = 100 * (mean - statistics.fmean(bacc.values()))
                paired = [100 * (acc[s] - bacc[s]) for s in acc if s in bacc]
                row["delta_std_pp"] = statistics.stdev(paired) if len(paired) > 1 else None
                if run.target is not None:
                    row["verdict"] = "met" if row["delta_pp"] >= -run.target else "missed"
        rows.append(row)
    return rows


def _fmt(value, digits, scale=1.0):
    return "" if value is None else f"{value * scale:.{digits}f}"


def accuracy_markdown(rows):
    """The accuracy table as Markdown (accuracy in %, differences in percentage points)."""
    lines = ["| experiment | GPUs | precision | seeds | final test accuracy % (mean ± std) | min-max % "
             "| vs baseline, pp (paired std) | target pp | |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        std = f" ± {_fmt(r['std'], 2, 100)}" if r["std"] is not None else ""
        delta = _fmt(r["delta_pp"], 2)
        if delta and r["delta_std_pp"] is not None:
            delta += f" ({_fmt(r['delta_std_pp'], 2)})"
        target = f"≥ -{r['target_pp']:g}" if r["target_pp"] is not None else ""
        lines.append(f"| {r['experiment']} | {r['gpus']} | {r['label']} | {r['seeds']} | "
                     f"{_fmt(r['mean'], 2, 100)}{std} | {_fmt(r['min'], 2, 100)}-{_fmt(r['max'], 2, 100)} | "
                     f"{delta} | {target} | {r['verdict'] or ''} |")
    return "\n".join(lines) + "\n"


def write_accuracy(groups, out_dir):
    """``accuracy.csv`` and ``accuracy.md`` under ``out_dir``; returns the rows."""
    rows = accuracy_rows(groups)
    if not rows:
        return rows
    out_dir = Path(out_dir)
    with open(out_dir / "accuracy.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out_dir / "accuracy.md").write_text(accuracy_markdown(rows))
    return rows


def t_quantile(p, dof):
    """The ``p`` quantile of Student's t with ``dof`` degrees of freedom."""
    from scipy.stats import t
    return float(t.ppf(p, dof))


CURVES = {"loss": lambda d: [y for _, y in d["loss"]],            # train loss at each logged step
          "test_accuracy": lambda d: [e[1] for e in d["epochs"]],
          "test_loss": lambda d: [e[2] for e in d["epochs"]]}


def curve_gap(base, other, curve="loss", alpha=1e-2, comparisons=1):
    """Whether ``other``'s runs learned as ``base``'s do (module doc): ``base`` and ``other`` are lists
    of :func:`load` results, one per seed; ``curve`` is a key of :data:`CURVES`. Returns ``{"gap",
    "tolerance", "ok", "base_std"}``."""
    def area(d):
        return statistics.fmean(CURVES[curve](d))
    a, b = [area(d) for d in other], [area(d) for d in base]
    if len(b) < 2 or not a:
        raise ValueError("curve_gap needs at least 2 baseline seeds and 1 other")
    s = statistics.stdev(b)
    tol = t_quantile(1 - alpha / (2 * comparisons), len(b) - 1) * s * math.sqrt(1 / len(a) + 1 / len(b))
    gap = statistics.fmean(a) - statistics.fmean(b)
    return {"gap": gap, "tolerance": tol, "ok": abs(gap) <= tol, "base_std": s}


# ----------------------------------------------------------------------------- figures

def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curve(series):
    """Points present in every seed's curve: ``(xs, mean, min, max)``."""
    by_x = OrderedDict()
    for points in series:
        for x, y in points:
            by_x.setdefault(x, []).append(y)
    xs = [x for x, ys in by_x.items() if len(ys) == len(series)]
    return (xs, [statistics.fmean(by_x[x]) for x in xs], [min(by_x[x]) for x in xs],
            [max(by_x[x]) for x in xs])


def plot_accuracy(groups, fig_dir, note=""):
    """One figure per experiment and GPU count with test accuracy curves; returns the paths."""
    plt = _pyplot()
    by_exp = OrderedDict()
    for (matrix, exp, gpus, nodes, key), g in groups.items():
        if g["data"] and any(d["epochs"] for d in g["data"].values()):
            by_exp.setdefault((matrix, exp, gpus, nodes), []).append((key, g))
    paths = []
    for (matrix, exp, gpus, nodes), members in by_exp.items():
        fig, (ax_acc, ax_loss, ax_bar) = plt.subplots(1, 3, figsize=(17, 4.8))
        labels, means, errs = [], [], []
        for i, (key, g) in enumerate(members):
            color = plt.cm.tab10(i % 10)
            label = g["runs"][0].precision
            data = list(g["data"].values())
            xs, mean, lo, hi = _mean_curve([[(e[0] + 1, 100 * e[1]) for e in d["epochs"]] for d in data])
            ax_acc.plot(xs, mean, marker="o", ms=3, color=color, label=f"{label} (n={len(data)})")
            ax_acc.fill_between(xs, lo, hi, color=color, alpha=0.15)
            xs, mean, _, _ = _mean_curve([d["loss"] for d in data])
            ax_loss.plot(xs, mean, color=color, label=label)
            finals = [100 * a for a in final_accuracies(g).values()]
            labels.append(label)
            means.append(statistics.fmean(finals))
            errs.append(statistics.stdev(finals) if len(finals) > 1 else 0.0)
        ax_acc.set(xlabel="epoch", ylabel="test accuracy (%)", title="test accuracy: mean, min-max band")
        ax_loss.set(xlabel="step", ylabel="train loss", title="train loss (mean over seeds)", yscale="log")
        ax_bar.bar(range(len(labels)), means, yerr=errs, capsize=3,
                   color=[plt.cm.tab10(i % 10) for i in range(len(labels))])
        lo = min(m - e for m, e in zip(means, errs))
        ax_bar.set_ylim(max(0.0, lo - 2.0), min(100.0, max(m + e for m, e in zip(means, errs)) + 1.0))
        ax_bar.set_xticks(range(len(labels)), labels, rotation=35, ha="right", fontsize=8)
        ax_bar.set(ylabel="final test accuracy (%)", title="final accuracy: mean ± std over seeds")
        ax_acc.legend(fontsize=7)
        ax_acc.grid(alpha=0.3)
        ax_loss.grid(alpha=0.3)
        fig.suptitle(f"{exp}, {gpus} rank(s){f' on {nodes} nodes' if nodes > 1 else ''}"
                     f"{f' - {note}' if note else ''}", fontsize=10)
        paths.append(_save(plt, fig, Path(fig_dir) / f"{matrix}.{exp}.{gpus}g.accuracy.png"))
    return paths


def _published_rate(run):
    """The published data/sec beside ``run`` (one machine's figure where the reference has several)."""
    ref = run.reference or {}
    if "samples_per_sec" in ref:
        return ref["samples_per_sec"]
    rates = [v["data_per_sec"] for v in ref.values() if isinstance(v, dict) and "data_per_sec" in v]
    return max(rates) if rates else None


def throughput_rows(groups):
    """Per group: our data/sec (mean over seeds), the published one, bytes per step, and the speedups
    over the baseline (32bit) at the same GPU count."""
    rows = []
    for (matrix, exp, gpus, nodes, key), g in groups.items():
        run = g["runs"][0]
        rates = [d["summary"].get("bench_data_per_sec") for d in g["data"].values()]
        rates = [r for r in rates if r]
        sent = [d["summary"].get("measured_bytes_sent") or d["summary"].get("bytes_sent_per_step")
                for d in g["data"].values()]
        fp32 = [d["summary"].get("measured_bytes_fp32") or d["summary"].get("bytes_fp32_per_step")
                for d in g["data"].values()]
        rows.append(dict(matrix=matrix, experiment=exp, gpus=gpus, nodes=nodes, key=key,
                         label=run.precision, baseline=run.baseline,
                         rate=statistics.fmean(rates) if rates else None,
                         published=_published_rate(run),
                         bytes_sent=next((b for b in sent if b), None),
                         bytes_fp32=next((b for b in fp32 if b), None)))
    index = {(r["matrix"], r["experiment"], r["gpus"], r["nodes"], r["key"]): r for r in rows}
    for r in rows:
        base = index.get((r["matrix"], r["experiment"], r["gpus"], r["nodes"], r["baseline"] or "32bit"))
        for col, out in (("rate", "speedup"), ("published", "published_speedup")):
            ok = base is not None and r[col] and base[col]
            r[out] = r[col] / base[col] if ok else None
    return rows


def plot_throughput(rows, fig_dir, note=""):
    """``<matrix>.throughput.png`` and ``<matrix>.bytes.png`` per matrix (module doc)."""
    plt = _pyplot()
    paths = []
    for matrix in OrderedDict.fromkeys(r["matrix"] for r in rows):
        measured = {r["experiment"] for r in rows if r["matrix"] == matrix and r["rate"]}
        mrows = [r for r in rows if r["matrix"] == matrix and r["experiment"] in measured
                 and (r["rate"] or r["published"])]
        exps = list(OrderedDict.fromkeys(r["experiment"] for r in mrows))
        if not exps:
            continue
        fig, axes = plt.subplots(len(exps), 2, figsize=(15, 3.6 * len(exps)), squeeze=False)
        for (ax_rate, ax_speed), exp in zip(axes, exps):
            erows = [r for r in mrows if r["experiment"] == exp]
            cols = list(OrderedDict.fromkeys((r["gpus"], r["nodes"]) for r in erows))
            labels = list(OrderedDict.fromkeys(r["label"] for r in erows))
            width = 0.8 / (2 * len(labels))
            named = set()           # legend entries already made (the first bar of each kind)
            for i, label in enumerate(labels):
                color = plt.cm.tab10(i % 10)
                for j, (gpus, nodes) in enumerate(cols):
                    r = next((x for x in erows if x["label"] == label and (x["gpus"], x["nodes"]) == (gpus, nodes)), None)
                    if r is None:
                        continue
                    x = j + (2 * i - len(labels) + 0.5) * width
                    for ax, ours, theirs in ((ax_rate, r["rate"], r["published"]),
                                             (ax_speed, r["speedup"], r["published_speedup"])):
                        for value, name, style in ((ours, label, {}),
                                                   (theirs, f"{label}, published",
                                                    {"alpha": 0.45, "hatch": "//"})):
                            if value:
                                ax.bar(x + (width if style else 0), value, width, color=color,
                                       label=None if (ax, name) in named else name, **style)
                                named.add((ax, name))
            ticks = [f"N={g}" + (f", {n} nodes" if n > 1 else "") for g, n in cols]
            for ax, ylabel in ((ax_rate, "data/sec (all ranks)"), (ax_speed, "speedup over 32bit")):
                ax.set_xticks(range(len(cols)), ticks)
                ax.set(ylabel=ylabel, title=exp, xlabel="GPUs (published) or ranks (ours)")
                ax.grid(axis="y", alpha=0.3)
            ax_speed.axhline(1.0, color="black", lw=0.8)
            ax_rate.legend(fontsize=6, ncol=2)
        fig.suptitle(f"{matrix}: ours solid, published hatched{f' - {note}' if note else ''}", fontsize=10)
        paths.append(_save(plt, fig, Path(fig_dir) / f"{matrix}.throughput.png"))

        brows = [r for r in rows if r["matrix"] == matrix and r["bytes_sent"]]
        if brows:
            fig, ax = plt.subplots(figsize=(max(6.0, 0.45 * len(brows)), 4.2))
            names = [f"{r['experiment']}\n{r['label']}, {r['gpus']}g" for r in brows]
            ax.bar(range(len(brows)), [r["bytes_fp32"] or 0 for r in brows], color="lightgray",
                   label="fp32 allreduce")
            ax.bar(range(len(brows)), [r["bytes_sent"] for r in brows], width=0.5, label="sent")
            ax.set_xticks(range(len(brows)), names, rotation=60, ha="right", fontsize=6)
            ax.set(ylabel="bytes per rank per step", yscale="log", title=f"{matrix}: bytes per step")
            ax.legend(fontsize=7)
            paths.append(_save(plt, fig, Path(fig_dir) / f"{matrix}.bytes.png"))
    return paths


def report(runs, out_dir, note=""):
    """The accuracy table and every figure of ``runs``' finished runs under ``out_dir``."""
    out_dir = Path(out_dir)
    groups = group_runs(runs, out_dir)
    rows = write_accuracy(groups, out_dir)
    if rows:
        print(accuracy_markdown(rows), end="")
        print(f"accuracy table: {out_dir / 'accuracy.md'}, {out_dir / 'accuracy.csv'}")
    fig_dir = out_dir / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    speed = throughput_rows(groups)
    paths = plot_accuracy(groups, fig_dir, note) + plot_throughput(speed, fig_dir, note)
    for p in paths:
        print(f"figure: {p}")
    with open(out_dir / "throughput.json", "w") as f:
        json.dump(speed, f, indent=1)
    return rows, paths
