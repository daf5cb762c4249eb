"""Render the docs' result tables (and figures) from the data files under docs/data/.

A generated table sits in a markdown file between two markers, the data file's path relative to docs/:

    <!-- table: data/NAME.json -->
    ... generated: a markdown table and one source line ...
    <!-- /table -->

Each data file is one JSON object:

    title     str   what the table shows
    command   str   the exact command that produced the numbers (lines joined by "; " when rendered)
    commit    str   git short hash of the code the numbers were measured at
    machine   str   e.g. "2 x NVIDIA H200 of a 4 x H200 host" or "2-core CPU VM"
    date      str   YYYY-MM-DD
    versions  dict  library name -> version
    columns   list  column headings
    rows      list  of rows, each a list of cells (str, number or null) as long as `columns`
    notes     str   optional: shown under the table
    raw / raw_file  optional: per-run records, or a sibling CSV file holding them
    figure    dict  optional: {"file": "figures/NAME.png", "kind": "speedup_bars" | "column_bars", ...},
                    drawn by --figures

A marker whose data file does not exist renders as a line saying the data is not yet measured.

    python scripts/docs_tables.py            # rewrite every marked block in README.md and docs/*.md
    python scripts/docs_tables.py --check    # exit 1 naming each block that differs from its data
    python scripts/docs_tables.py --figures  # also redraw the figures named by data files (matplotlib)
"""
import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = {"title": str, "command": str, "commit": str, "machine": str, "date": str,
            "versions": dict, "columns": list, "rows": list}
BLOCK = re.compile(r"(<!-- table: (?P<path>[^ ]+) -->\n)(?P<body>.*?)(<!-- /table -->)", re.S)


def load(path):
    """The data file at `path`, checked against the format above (a ValueError names the fault)."""
    data = json.loads(Path(path).read_text())
    for key, kind in REQUIRED.items():
        if not isinstance(data.get(key), kind):
            raise ValueError(f"{path}: key {key!r} missing or not a {kind.__name__}")
    if not re.fullmatch(r"[0-9a-f]{7,40}", data["commit"]):
        raise ValueError(f"{path}: commit {data['commit']!r} is not a git hash")
    if not re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]):
        raise ValueError(f"{path}: date {data['date']!r} is not YYYY-MM-DD")
    if "raw_file" in data and not (Path(path).parent / data["raw_file"]).is_file():
        raise ValueError(f"{path}: raw_file {data['raw_file']!r} is not beside it")
    for i, row in enumerate(data["rows"]):
        if len(row) != len(data["columns"]):
            raise ValueError(f"{path}: row {i} has {len(row)} cells for {len(data['columns'])} columns")
    return data


def cell(value):
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value)
    return str(value).replace("|", "\\|")


def render(data):
    """The markdown of one block: the table, the notes, and the source line."""
    cols = data["columns"]
    numeric = [i > 0 and all(re.match(r"[-+]?[\d.]", cell(r[i])) for r in data["rows"] if cell(r[i]))
               for i in range(len(cols))]
    lines = ["| " + " | ".join(cell(c) for c in cols) + " |",
             "|" + "|".join("---:" if n else "---" for n in numeric) + "|"]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in data["rows"]]
    out = "\n".join(lines) + "\n"
    if data.get("notes"):
        out += "\n" + data["notes"].strip() + "\n"
    command = "; ".join(line.strip() for line in data["command"].strip().splitlines())
    versions = ", ".join(f"{k} {v}" for k, v in data["versions"].items())
    out += (f"\nSource: `{command}` at commit {data['commit']}, {data['machine']}, {data['date']}"
            + (f" ({versions})" if versions else "") + ".\n")
    return out


def missing(rel):
    return f"*Not yet measured: `{rel}` is not committed yet.*\n"


def rewrite(text, docs_dir):
    """`text` with every marked block rendered from its data file, and the paths of the blocks that changed."""
    changed = []

    def one(m):
        rel = m.group("path")
        path = docs_dir / rel
        body = render(load(path)) if path.exists() else missing(rel)
        if body != m.group("body"):
            changed.append(rel)
        return m.group(1) + body + m.group(4)

    return BLOCK.sub(one, text), changed


def doc_files(root):
    return [root / "README.md"] + sorted((root / "docs").glob("*.md"))


def run(root=ROOT, check=False):
    """Rewrite (or, with check, only compare) every doc under `root`; returns ["FILE: data/NAME.json", ...]."""
    root = Path(root)
    differ = []
    for doc in doc_files(root):
        if not doc.exists():
            continue
        text = doc.read_text()
        new, changed = rewrite(text, root / "docs")
        differ += [f"{doc.relative_to(root)}: {rel}" for rel in changed]
        if changed and not check:
            doc.write_text(new)
    return differ


def speedup_bars(data, spec, out):
    """One panel per value of spec["panel"]; per row, ours and the published ratio side by side."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    col = {c: i for i, c in enumerate(data["columns"])}
    panels = {}
    for row in data["rows"]:
        panels.setdefault(row[col[spec["panel"]]], []).append(row)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels.items()):
        labels = [" ".join(str(r[col[c]]) for c in spec["label"]) for r in rows]
        x = range(len(rows))
        for k, (series, hatch) in enumerate(zip(spec["series"], ("", "//"))):
            ys = [float(r[col[series]]) for r in rows]
            ax.bar([i + (k - 0.5) * 0.4 for i in x], ys, 0.4, label=series, hatch=hatch,
                   color="white" if hatch else None, edgecolor="black" if hatch else None)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=8)
        ax.set_title(name, fontsize=10)
        ax.set_ylabel(spec.get("ylabel", ""))
    axes[0][0].legend(fontsize=8)
    fig.suptitle(data["title"], fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def column_bars(data, spec, out):
    """One panel per column after the first; one bar per row, the cell's leading number (blank: no bar)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cols = data["columns"][1:]
    fig, axes = plt.subplots(1, len(cols), figsize=(3.0 * len(cols), 4.2), squeeze=False, sharey=False)
    for j, (ax, name) in enumerate(zip(axes[0], cols)):
        labels, ys = [], []
        for row in data["rows"]:
            m = re.match(r"[-+]?\d+(?:\.\d+)?", cell(row[j + 1]))
            if m:
                labels.append(cell(row[0]).replace("`", ""))
                ys.append(float(m.group()))
        ax.barh(range(len(ys)), ys, color=["tab:green" if s.startswith(spec.get("ours", "hvdq")) or
                                          s.startswith("stock") else "tab:blue" for s in labels])
        ax.set_yticks(range(len(ys)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_title(name, fontsize=9)
        ax.set_xlabel(spec.get("xlabel", ""), fontsize=8)
    fig.suptitle(data["title"], fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


FIGURES = {"speedup_bars": speedup_bars, "column_bars": column_bars}


def figures(root=ROOT):
    docs = Path(root) / "docs"
    for path in sorted((docs / "data").glob("*.json")):
        data = load(path)
        spec = data.get("figure")
        if spec:
            FIGURES[spec["kind"]](data, spec, docs / spec["file"])
            print(f"drew {spec['file']} from {path.relative_to(docs)}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 naming each block that differs")
    p.add_argument("--figures", action="store_true", help="also redraw the figures named by the data files")
    p.add_argument("--root", default=str(ROOT), help="the repository root (default: this script's)")
    a = p.parse_args(argv)
    differ = run(a.root, check=a.check)
    for d in differ:
        print(("differs from its data: " if a.check else "rewrote: ") + d)
    if a.figures:
        figures(a.root)
    return 1 if (a.check and differ) else 0


if __name__ == "__main__":
    sys.exit(main())
