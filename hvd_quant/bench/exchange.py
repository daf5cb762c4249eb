"""Benchmark: fp32 ``hvd.allreduce`` against hvd_quant's SRA and allgather exchanges, in one run.

Run it under Horovod (every rank runs the same thing)::

    horovodrun -np 2 -H localhost:2 --gloo python -m hvd_quant.bench exchange \\
        --sizes vgg16=1.38e6,resnet50=2.56e5 --iters 5

    # GPUs (NCCL); add NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 for NCCL over sockets
    horovodrun -np 2 -H localhost:2 python -m hvd_quant.bench exchange --device cuda

For each gradient size (default: VGG-16's 138M and ResNet-50's 25.6M float32 elements) it times, per
iteration and as the slowest rank saw it:

* ``fp32``: one ``hvd.allreduce`` (Average) of the whole flat gradient;
* ``<reduction>/<codec>``: the gradient split into buckets of ``--bucket-bytes``, every bucket's
  exchange started, then all advanced and finished (what ``hvd_quant.torch.DistributedOptimizer`` does
  at ``synchronize()``), then the division by N. Encode and decode are inside the time, and so are
  the copies into the bucket buffers and out of the results, which are kept from step to step as the
  optimizer keeps them.

and prints the median time, the speedup over fp32, the bytes each rank sent (the exchange's own
count) with the ratio to fp32's ring allreduce, the effective bandwidth of the exchange's collectives
(``Traffic.bandwidth()`` over the timed iterations: this rank's bytes over the time its alltoalls
(``a2a GB/s``), its allgathers (``ag GB/s``) and any of them (``GB/s``) were in flight, the lowest
over the ranks; docs/EXCHANGE.md says what the marks measure; fp32's row: the ring allreduce's bytes
over its median time), and the relative L2 error of the result against fp32's. The default codecs
are QSGD at 16, 12, 10, 8, 4 and 2 bits (the study's rows) and 1-bit. ``--json PATH`` writes the same rows
as JSON (rank 0).
"""
import argparse
import json
import statistics
import sys
import time

DEFAULT_SIZES = "vgg16=138e6,resnet50=25.6e6"
DEFAULT_CODECS = ("qsgd:bits=16,bucket_size=512", "qsgd:bits=12,bucket_size=512",
                  "qsgd:bits=10,bucket_size=512", "qsgd:bits=8,bucket_size=512",
                  "qsgd:bits=4,bucket_size=512", "qsgd:bits=2,bucket_size=128", "onebit:bucket_size=512")
DEFAULT_REDUCTIONS = ("sra", "allgather")


def parse_sizes(text):
    out = []
    for item in text.split(","):
        name, _, n = item.partition("=")
        out.append((name.strip(), int(float(n))))
    return out


def _gbps(v):
    return f"{'-':>9}" if v is None else f"{v:>9.3f}"


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_quant.bench exchange", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default=DEFAULT_SIZES,
                   help=f"name=elements,... (default {DEFAULT_SIZES})")
    p.add_argument("--codecs", default=";".join(DEFAULT_CODECS),
                   help="codec specs separated by ';'")
    p.add_argument("--reductions", default=",".join(DEFAULT_REDUCTIONS))
    p.add_argument("--bucket-bytes", type=float, default=64 << 20,
                   help="float32 bytes per fused bucket (default 64 MiB)")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--json", default=None, help="write the rows to this file (rank 0)")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    import torch
    import horovod.torch as hvd

    import hvd_quant
    from hvd_quant.exchange import Exchange, Traffic
    from hvd_quant.torch import _backend

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank())
        device = torch.device("cuda", hvd.local_rank())
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    coll = _backend.collectives()
    ops = _backend.OPS
    tick = [0]

    def barrier():
        tick[0] += 1
        hvd.allreduce(torch.zeros(1), name=f"bench.barrier.{tick[0]}")

    def slowest(seconds):
        tick[0] += 1
        return float(hvd.allreduce(torch.tensor([seconds]), op=hvd.Max, name=f"bench.max.{tick[0]}"))

    def lowest(value):
        """The lowest ``value`` over the ranks (None where any rank has none)."""
        tick[0] += 1
        v = torch.tensor([float("nan") if value is None else value], dtype=torch.float64)
        v = float(hvd.allreduce(v, op=hvd.Min, name=f"bench.min.{tick[0]}"))
        return None if v != v else v

    def timed(fn):
        times, out = [], None
        for i in range(args.warmup + args.iters):
            barrier()
            sync()
            t0 = time.perf_counter()
            out = fn(i)
            sync()
            dt = slowest(time.perf_counter() - t0)
            if i >= args.warmup:
                times.append(dt)
        return statistics.median(times), out

    rows = []
    codecs = [c for c in args.codecs.split(";") if c]
    reductions = [r for r in args.reductions.split(",") if r]
    if rank == 0:
        print(f"# hvd_quant exchange benchmark: {size} ranks, device {args.device}, bucket_bytes "
              f"{int(args.bucket_bytes)}, {args.iters} iterations (median of the slowest rank)",
              flush=True)
        print(f"{'gradient':<10} {'method':<40} {'ms':>10} {'speedup':>8} {'MB sent':>10} "
              f"{'x fewer':>8} {'a2a GB/s':>9} {'ag GB/s':>9} {'GB/s':>9} {'rel.err':>9}", flush=True)
    for gname, n in parse_sizes(args.sizes):
        g = torch.Generator().manual_seed(rank)
        grad = torch.randn(n, generator=g).to(device)
        fp32_bytes = 2.0 * (size - 1) / size * 4 * n

        def fp32(i):
            return hvd.allreduce(grad, name=f"bench.fp32.{gname}.{i}", op=hvd.Average)
        t_fp32, ref = timed(fp32)
        rows.append(dict(gradient=gname, numel=n, method="fp32 allreduce", ms=t_fp32 * 1e3, speedup=1.0,
                         sent_bytes=fp32_bytes, ratio=1.0, rel_err=0.0, ranks=size, gbps_alltoall=None,
                         gbps_allgather=None, gbps=fp32_bytes / t_fp32 / 1e9))
        per = max(1, int(args.bucket_bytes) // 4)
        for reduction in reductions:
            for spec in codecs:
                codec = hvd_quant.from_spec(spec)
                ex = Exchange(codec, coll, ops, reduction=reduction, prefix="bench", reuse_result=True)
                # the buckets and the result are kept from step to step, as the optimizer keeps them
                # (a fresh buffer of this size costs tens of milliseconds of page faults per step)
                work = [grad[a:a + per].clone() for a in range(0, n, per)]
                result = torch.empty_like(grad)
                kept = Traffic()        # the timed iterations' collectives

                def run(i):
                    if i > args.warmup:
                        kept.add(ex.traffic)        # the previous iteration's, a timed one
                    ex.traffic.reset()
                    pend = []
                    for a, w in zip(range(0, n, per), work):
                        w.copy_(grad[a:a + per])
                        pend.append(ex.start(f"{gname}.{reduction}.{spec}.{a}", w, step=i))
                    for a, o in zip(range(0, n, per), ex.finish_all(pend)):
                        result[a:a + per].copy_(o)
                    return result.mul_(1.0 / size)
                t, out = timed(run)
                kept.add(ex.traffic)
                bw = kept.bandwidth()
                gbps = {k: lowest(bw.get(k, {}).get("gbps")) for k in ("alltoall", "allgather", "total")}
                err = float((out - ref).norm() / ref.norm().clamp_min(1e-30))
                sent = ex.traffic.sent_bytes
                rows.append(dict(gradient=gname, numel=n, method=f"{reduction} {spec}", ms=t * 1e3,
                                 speedup=t_fp32 / t, sent_bytes=sent,
                                 ratio=fp32_bytes / sent if sent else float("inf"), rel_err=err,
                                 ranks=size, gbps_alltoall=gbps["alltoall"],
                                 gbps_allgather=gbps["allgather"], gbps=gbps["total"]))
        if rank == 0:
            for r in rows:
                if r["gradient"] == gname:
                    print(f"{r['gradient']:<10} {r['method']:<40} {r['ms']:>10.2f} {r['speedup']:>8.2f} "
                          f"{r['sent_bytes'] / 1e6:>10.2f} {r['ratio']:>8.2f} {_gbps(r['gbps_alltoall'])} "
                          f"{_gbps(r['gbps_allgather'])} {_gbps(r['gbps'])} {r['rel_err']:>9.4f}",
                          flush=True)
    if rank == 0 and args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": list(sys.argv if argv is None else argv), "ranks": size,
                       "device": args.device, "rows": rows}, f, indent=1)
    hvd.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
