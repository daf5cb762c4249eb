#!/usr/bin/env python3
"""Steady-state step time of the stock TensorFlow path's ways, side by side in one process: one
``tf.function`` per way over the same Keras model (synthetic data, Horovod's
``hvd.DistributedGradientTape``), stepped in turns, five steps each per round, so that the machine's
drift hits each alike. ``reduction="auto"`` runs its schedule first, then its choice is set to the
way named (``auto-allreduce``, ``auto-allgather``, ``auto-sra``): what ``auto`` costs once decided.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/tf_stock_ab.py \\
        --ways fp32,auto-allreduce --rounds 12

Rank 0 prints the median step time of each way and its ratio to the first (higher is faster).
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import horovod.tensorflow as hvd


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ways", default="fp32,auto-allreduce",
                   help="fp32 | sra | allgather | auto-<allreduce|allgather|sra>, comma-separated")
    p.add_argument("--model", default="MobileNetV2")
    p.add_argument("--image", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--compression", default="qsgd:bits=4", help="hvd_quant spec of the codec")
    p.add_argument("--rounds", type=int, default=12)
    args = p.parse_args()

    hvd.init()
    import hvd_quant
    from hvd_quant.tensorflow import _graph
    from tf_synthetic import training_step
    make_step = training_step(args.model, args.image, args.batch_size)

    def make(compression):
        return make_step(lambda tape: hvd.DistributedGradientTape(tape, compression=compression))

    ways = args.ways.split(",")
    steps = {}
    for way in ways:
        if way == "fp32":
            steps[way] = make(hvd.Compression.none)
        else:
            reduction = "auto" if way.startswith("auto-") else way
            comp = hvd_quant.StockCompression(hvd_quant.from_spec(args.compression),
                                              reduction=reduction)
            steps[way] = make(comp)
            if reduction == "auto":
                for _ in range(20):         # the schedule (18 steps), then the choice
                    steps[way]()
                (auto,) = _graph._AUTOS[comp].values()
                auto.choice.choice = way[len("auto-"):]
        for _ in range(3):
            steps[way]()
    times = {w: [] for w in ways}
    for _ in range(args.rounds):
        for way in ways:
            for _ in range(5):
                t = time.perf_counter()
                steps[way]()
                times[way].append(time.perf_counter() - t)
    if hvd.rank() == 0:
        base = statistics.median(times[ways[0]])
        for way in ways:
            m = statistics.median(times[way])
            print(f"{way}: median {m * 1e3:.1f} ms, {base / m:.3f} of {ways[0]}'s speed", flush=True)


if __name__ == "__main__":
    main()
