"""Would KMeans keep its quality if Lloyd's steps ran on a sample instead of the whole bucket?

KMeans's CPU encode is slow because each Lloyd step needs the bucket's values in order (a radix sort
of the bucket, docs/CODECS.md). Running the steps on a sample of S values drawn from the bucket
(with its min and max, as the start sample) and then assigning every value to the final centroids
would cost a sort of S values and one pass. This script measures what that costs in accuracy on the
quality table's real gradients (one codebook per gradient, 20 steps, the codec's starts), against
Lloyd on the whole gradient. Sums are float64 here (the codec's are exact fixed point): the
comparison is of the fit, not of the bits.

    python scripts/kmeans_sample_fit.py --tasks mnist sst5 --steps 5
"""
import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

import quality_table  # noqa: E402
from numba_kernels.reference import KMEANS_SAMPLE, _kmeans_mids, _kmeans_starts  # noqa: E402


def lloyd(srt, c, iters):
    """``iters`` Lloyd steps from centroids ``c`` over the sorted values ``srt`` (prefix sums)."""
    prefix = np.concatenate([[0.0], np.cumsum(srt, dtype=np.float64)])
    for _ in range(iters):
        b = np.concatenate([[0], np.searchsorted(srt, _kmeans_mids(c), side="right"), [srt.size]])
        count, total = np.diff(b), prefix[b[1:]] - prefix[b[:-1]]
        c = c.copy()
        c[count > 0] = (total[count > 0] / count[count > 0]).astype(np.float32)
    return c


def rel_error(g, c):
    j = np.searchsorted(_kmeans_mids(c), g, side="left")
    return float(np.linalg.norm(c[j].astype(np.float64) - g) / np.linalg.norm(g.astype(np.float64)))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["mnist", "sst5"], choices=["mnist", "sst5"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--samples", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| task | bits | whole gradient | " + " | ".join(f"sample of {s:,}" for s in args.samples)
          + " | start only |")
    print("|---|---:|---:|" + "---:|" * (len(args.samples) + 1))
    for task in args.tasks:
        _, g = quality_table.task_gradient(task, args.steps, 0)
        whole = np.sort(g + np.float32(0))
        for bits in (2, 4, 6, 8):
            draws = g[rng.integers(0, g.size, max(args.samples))]
            ends = [g.min(), g.max()]
            start = np.sort(np.concatenate([draws[:KMEANS_SAMPLE - 2], ends]) + np.float32(0))
            c0 = start[_kmeans_starts(start, 1 << bits)].astype(np.float32)
            errs = [rel_error(g, lloyd(whole, c0, args.iters))]
            for s in args.samples:
                errs.append(rel_error(g, lloyd(np.sort(np.concatenate([draws[:s - 2], ends]) + np.float32(0)),
                                               c0, args.iters)))
            errs.append(rel_error(g, c0))
            cells = " | ".join(f"{e:.4f}" for e in errs)
            print(f"| {task} ({g.size:,}) | {bits} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
