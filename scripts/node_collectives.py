#!/usr/bin/env python3
"""Time Horovod's collectives inside an emulated node and across nodes, on CPU tensors.

What ``reduction="two_level"`` pays at each level (docs/EXCHANGE.md, "Two levels"): per rank, an fp32
allreduce, reducescatter and allgather of a bucket over the node's ranks, and a byte allgather of a
4-bit payload of this rank's part over the ranks with its local rank; beside them a numpy sum and copy
of the same floats, the memory's own cost. Run under ``scripts/slownet.py --nodes K``:

    python scripts/slownet.py --np 4 --nodes 2 -- python scripts/node_collectives.py --numel 10500000

Rank 0 prints one line per operation: the median of ``--repeat`` timed calls after one warm-up.
"""
import argparse

import numpy as np
import torch
import horovod.torch as hvd

from hvd_quant.bench.codec import CpuTimer


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--numel", type=int, default=10_500_000, help="floats in the bucket (default 10.5M)")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    hvd.init(process_sets="dynamic")
    size, local = hvd.size(), hvd.local_size()
    nodes = [list(range(c * local, (c + 1) * local)) for c in range(size // local)]
    sets = [hvd.add_process_set(r) for r in nodes + [list(c) for c in zip(*nodes)]]
    node, cross = sets[hvd.cross_rank()], sets[len(nodes) + hvd.local_rank()]
    x = torch.randn(args.numel)
    part = x[: args.numel // local].clone()
    payload = torch.zeros(args.numel // local // 2, dtype=torch.uint8)
    rows = [
        ("numpy sum of two buckets", lambda: np.add(x.numpy(), x.numpy())),
        ("numpy copy of a bucket", lambda: x.numpy().copy()),
        ("node allreduce, fp32 bucket", lambda: hvd.allreduce(x, op=hvd.Sum, process_set=node)),
        ("node reducescatter, fp32 bucket", lambda: hvd.reducescatter(x, op=hvd.Sum, process_set=node)),
        ("node allgather, fp32 part", lambda: hvd.allgather(part, process_set=node)),
        ("cross allgather, 4-bit part", lambda: hvd.allgather(payload, process_set=cross)),
    ]
    timer = CpuTimer()
    for what, fn in rows:
        ms, _ = timer(fn, args.repeat, warmup=1)
        if hvd.rank() == 0:
            print(f"{what:34s} {ms:8.1f} ms  ({args.numel} floats, {local} ranks a node, "
                  f"{size // local} nodes)", flush=True)


if __name__ == "__main__":
    main()
