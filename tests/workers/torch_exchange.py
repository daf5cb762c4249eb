"""Worker: the framework-free exchange (hvd_quant.exchange) on torch tensors, on real collectives.

For every codec x reduction x size (sizes on either side of the bucket size and of the chunk
boundaries, plus 0 and 1), every rank builds every rank's input (seeded by rank), runs the exchange,
and checks:

* exact: the result equals, bit for bit, the same pipeline replayed locally from every rank's input
  (encode each rank's data as that rank would, decode and sum in rank order, and for SRA requantize
  each chunk as its owner would) -- the collectives moved the right bytes to the right place;
* error bound against the exact float64 sum (the fp32 allreduce's answer):
  - deterministic QSGD rounds to nearest: |error| <= unit/2 per quantization, unit = bucket max / s,
    s = 2^(bits-1) - 1. allgather quantizes each rank's data once: sum_j m_j / (2s) per bucket
    (m_j: rank j's max |x| in the bucket); SRA also requantizes the reduced chunk, whose max is at most
    sum_j m_j: sum_j m_j / s in all;
  - stochastic QSGD moves to one of the two neighbouring levels: |error| < unit per quantization
    (twice the deterministic bound), zero mean, and variance <= unit^2/4 per quantization;
  - fp16: relative 2^-11 per rounding (once for allgather, twice for SRA);
  - none: float32 summation only;
* the result is the same bytes on every rank; a NaN in one rank's input is NaN in everyone's result;
* the bytes handed to the collectives, counted on the wire, match ``Traffic`` and the formula;
* every collective is timed (``Traffic.bandwidth``): per kind, its bytes are this rank's share of the
  wire count and sum to ``Traffic.sent_bytes``, its time is positive and finite; with several buckets
  and steps in flight the union of the intervals is no longer than their sum;
* a rank sending another size, another tensor's payload or another configuration makes every rank
  raise a clear error (no hang, no garbage).
"""
import dataclasses
import math
import time

import torch

import horovod.torch as hvd

import hvd_quant
from hvd_quant.exchange import (ConfigMismatchError, Exchange, PayloadMismatchError, chunk_bounds,
                                codec_alignment, handshake_record)
from hvd_quant.torch import _backend

from torch_common import DEVICE, Checks, all_ranks_true, init, same_on_all_ranks

R, N = init()
OPS = _backend.OPS
check = Checks()

SPECS = {
    "qsgd8_det": "qsgd:bits=8,bucket_size=512,mode=deterministic,norm=max",
    "qsgd4_det": "qsgd:bits=4,bucket_size=512,mode=deterministic,norm=max",
    "qsgd2_det": "qsgd:bits=2,bucket_size=128,mode=deterministic,norm=max",
    "qsgd4_sto": "qsgd:bits=4,bucket_size=512,mode=stochastic,norm=max,seed=7",
    "onebit": "onebit:bucket_size=64",
    "sortquant4_det": "sortquant:bits=4,split_bits=2,bucket_size=512,mode=deterministic",
    "sortquant4_sto": "sortquant:bits=4,split_bits=2,bucket_size=128,mode=stochastic,seed=7",
    "kmeans3": "kmeans:bits=3,iters=6",
    "kmeans4_b128": "kmeans:bits=4,iters=4,bucket_size=128,seed=5",
    "fp16": "fp16",
    "none": "none",
}
SIZES = [0, 1, 127, 511, 512, 513, 2 * 512 * 3 + 77, 20000]
FP32_EPS = 2.0 ** -23


def codec_for(spec, rank):
    """A codec whose encode draws what rank ``rank`` draws at a step (``encode(..., step, rank)``)."""
    c = hvd_quant.from_spec(spec)
    return lambda x, name, step: c.encode(x, name=name, step=step, rank=rank), c


def inputs(n, case, nan_at=None):
    xs = []
    for j in range(N):
        g = torch.Generator().manual_seed(1000 * j + 17 * n + case)
        x = torch.randn(n, generator=g) * (1.0 + j)         # ranks differ in scale too
        if nan_at is not None and j == 0 and n > nan_at:
            x[nan_at] = float("nan")
        xs.append(x)
    return xs


def replay(spec, reduction, xs, name, step):
    """The exchange's result, recomputed locally from every rank's input (module doc)."""
    n = xs[0].numel()
    out = torch.zeros(n)
    if n == 0:
        return out
    if reduction == "allgather":
        tag = f"{name}#all"
        for j, x in enumerate(xs):
            enc, c = codec_for(spec, j)
            c.decode_into(enc(x.clone(), tag, step), out, accumulate=True)
        return out
    align = codec_alignment(hvd_quant.from_spec(spec))
    for owner, (a, b) in enumerate(chunk_bounds(n, N, align)):
        if b == a:
            continue
        acc = torch.zeros(b - a)
        for j, x in enumerate(xs):
            enc, c = codec_for(spec, j)
            c.decode_into(enc(x[a:b].clone(), f"{name}#c{owner}", step), acc, accumulate=True)
        enc, c = codec_for(spec, owner)
        c.decode_into(enc(acc, f"{name}#r{owner}", step), out[a:b])
    return out


def bound(spec, reduction, xs):
    """Per-element |error| bound of the exchange's sum against the exact sum (module doc)."""
    codec = hvd_quant.from_spec(spec)
    n = xs[0].numel()
    quantizations = 1 if reduction == "allgather" else 2
    if spec.startswith("qsgd"):
        s = (1 << (codec.bits - 1)) - 1
        d = codec.bucket_size
        nb = -(-n // d)
        m = torch.zeros(nb, dtype=torch.float64)
        for x in xs:
            pad = torch.zeros(nb * d, dtype=torch.float64)
            pad[:n] = x.double().abs()
            m += pad.view(nb, d).amax(1)
        per_q = m / s * (0.5 if "deterministic" in spec else 1.0)
        # SRA's second quantization: the reduced chunk's max is at most sum_j m_j (same per_q).
        b = (per_q * quantizations).repeat_interleave(d)[:n]
        return b + 8 * FP32_EPS * m.repeat_interleave(d)[:n] * N
    if spec.startswith(("sortquant", "kmeans")):
        # A group's unit, (max - min) / L with L = 2^(bits - split_bits) - 1, is at most its bucket's
        # range over L; the reduced chunk's bucket range is at most the sum of the ranks' ranges.
        # KMeans: a value and its centroid (a mean of the bucket's values) both lie in the bucket's
        # range (L = 1); with one bucket per tensor, SRA's chunks are parts of the tensor's range.
        L = (1 << (codec.bits - codec.split_bits)) - 1 if spec.startswith("sortquant") else 1
        d = codec.bucket_size or max(n, 1)
        nb = -(-n // d)
        rng, m = torch.zeros(nb, dtype=torch.float64), torch.zeros(nb, dtype=torch.float64)
        for x in xs:
            pad = torch.zeros(nb * d, dtype=torch.float64)
            pad[:n] = x.double()
            lo = torch.full((nb * d,), float("inf"), dtype=torch.float64)
            lo[:n] = x.double()
            hi = torch.full((nb * d,), float("-inf"), dtype=torch.float64)
            hi[:n] = x.double()
            rng += hi.view(nb, d).amax(1) - lo.view(nb, d).amin(1)
            m += pad.abs().view(nb, d).amax(1)
        per_q = rng / L * (0.5 if "deterministic" in spec else 1.0)
        b = (per_q * quantizations).repeat_interleave(d)[:n]
        return b + 8 * FP32_EPS * m.repeat_interleave(d)[:n] * N
    absum = sum(x.double().abs() for x in xs)
    if spec == "fp16":
        return absum * (2.0 ** -11) * quantizations * 1.01 + 8 * FP32_EPS * absum * N
    if spec == "none":
        return absum * FP32_EPS * 2 * N
    return None


def counting(coll, log):
    """The same Collectives, recording the bytes of every uint8 tensor handed to a collective."""
    def ag(t, name, sizes=None):
        log.append(("allgather", t.numel()))
        return coll.allgather_async(t, name, sizes=sizes)

    def a2a(t, splits, name):
        log.append(("alltoall", list(splits)))
        return coll.alltoall_async(t, splits, name)
    return dataclasses.replace(coll, allgather_async=ag, alltoall_async=a2a)


def exchange_cases():
    coll = _backend.collectives()
    for key, spec in SPECS.items():
        for reduction in ("sra", "allgather"):
            for case, n in enumerate(SIZES):
                label = f"{key}/{reduction}/n={n}"
                xs = inputs(n, case)
                log = []
                ex = Exchange(hvd_quant.from_spec(spec), counting(coll, log), OPS, reduction=reduction)
                name = f"x.{key}.{reduction}.{n}"
                pending = ex.start(name, xs[R].clone().to(DEVICE), step=3)
                got = ex.finish(pending).cpu()
                expect = replay(spec, reduction, xs, name, 3)
                check(torch.equal(got, expect), f"exact {label}",
                      f"max diff {float((got - expect).abs().max()) if n else 0:.3g}")
                check(same_on_all_ranks(got), f"identical {label}")
                exact = sum(x.double() for x in xs)
                b = bound(spec, reduction, xs)
                if b is not None and n:
                    err = (got.double() - exact).abs()
                    worst = float((err / b.clamp_min(1e-30)).max())
                    check(bool((err <= b).all()), f"bound {label}", f"max error/bound {worst:.3f}")
                if key.endswith("_sto") and n >= 20000:
                    # Unbiased with variance <= unit^2/4 per quantization: the mean error over n
                    # elements is within 5 sigma of 0, the mean squared error under the bound.
                    err = got.double() - exact
                    var_b = (bound(spec, reduction, xs) / 2) ** 2   # (unit/2)^2 summed per element
                    sigma = math.sqrt(float(var_b.sum())) / n
                    check(abs(float(err.mean())) <= 5 * sigma, f"unbiased {label}",
                          f"mean {float(err.mean()):.3g} sigma {sigma:.3g}")
                    check(float((err ** 2).mean()) <= float(var_b.mean()), f"variance {label}",
                          f"mse {float((err ** 2).mean()):.3g} <= {float(var_b.mean()):.3g}")
                # Bytes on the wire: what this rank handed to the collectives, against Traffic.
                codec = hvd_quant.from_spec(spec)
                wire = lambda k: codec.wire_nbytes(k) if k else 0  # noqa: E731
                if reduction == "sra":
                    splits = [wire(b_ - a_) for a_, b_ in chunk_bounds(n, N, codec_alignment(codec))]
                    expect_log = [("alltoall", splits), ("allgather", splits[R])]
                    sent = sum(splits) - splits[R] + (N - 1) * splits[R]
                else:
                    expect_log = [("allgather", wire(n))]
                    sent = (N - 1) * wire(n)
                check(log == expect_log, f"wire {label}", f"{log} vs {expect_log}")
                check(ex.traffic.sent_bytes == sent and ex.traffic.numel == n, f"traffic {label}",
                      f"{ex.traffic} vs sent={sent}")
                if reduction == "sra":
                    by_kind = {"alltoall": sum(splits) - splits[R], "allgather": (N - 1) * splits[R]}
                else:
                    by_kind = {"allgather": sent}
                bandwidth_ok(ex.traffic.bandwidth(), by_kind, sent, 1, label)


def bandwidth_ok(bw, by_kind, sent, count, label):
    """``Traffic.bandwidth()`` holds ``count`` collectives of each kind of ``by_kind`` (kind -> bytes
    this rank sent), bytes summing to ``sent``, positive finite times and GB/s = bytes / seconds."""
    kinds = set(by_kind) | {"total"}
    ok = (set(bw) == kinds and all(bw[k]["count"] == count and bw[k]["bytes"] == by_kind[k] for k in by_kind)
          and bw["total"]["count"] == count * len(by_kind) and bw["total"]["bytes"] == sent
          and all(0 < bw[k]["seconds"] < 60 and math.isfinite(bw[k]["gbps"])
                  and abs(bw[k]["gbps"] - bw[k]["bytes"] / bw[k]["seconds"] / 1e9) <= 1e-9 * bw[k]["gbps"]
                  for k in kinds)
          and bw["total"]["seconds"] <= sum(bw[k]["seconds"] for k in by_kind) * (1 + 1e-12))
    check(ok, f"bandwidth {label}", f"{bw} vs bytes {by_kind}, sent {sent}")


def bandwidth_cases():
    """Several buckets in flight (finish_all) over several steps, one Traffic for all of them, read
    once at the end: every collective counted once, bytes equal to Traffic's, the union of the
    intervals shorter than their sum; then timing=False records nothing."""
    coll = _backend.collectives()
    spec = SPECS["qsgd4_det"]
    for reduction in ("sra", "allgather"):
        log = []
        ex = Exchange(hvd_quant.from_spec(spec), counting(coll, log), OPS, reduction=reduction)
        sizes, steps = (3000, 20000, 513), 3
        for step in range(steps):
            pend = [ex.start(f"bw.{reduction}.{i}", torch.randn(n, device=DEVICE), step=step)
                    for i, n in enumerate(sizes)]
            ex.finish_all(pend)
        by_kind = {}
        for kind, v in log:
            by_kind[kind] = by_kind.get(kind, 0) + ((sum(v) - v[R]) if kind == "alltoall" else (N - 1) * v)
        bw = ex.traffic.bandwidth()
        bandwidth_ok(bw, by_kind, ex.traffic.sent_bytes, steps * len(sizes), f"{reduction}/in flight")
        check(bw == ex.traffic.bandwidth() and not ex.traffic.timed, f"bandwidth read twice/{reduction}")
        last = ex.traffic.copy()
        ex.traffic.reset()
        check(ex.traffic.bandwidth() == {} and last.bandwidth() == bw, f"bandwidth reset/{reduction}")
        ex = Exchange(hvd_quant.from_spec(spec), coll, OPS, reduction=reduction, timing=False)
        ex.finish(ex.start(f"bw.off.{reduction}", torch.randn(3000, device=DEVICE), step=0))
        check(ex.traffic.bandwidth() == {} and ex.traffic.sent_bytes > 0, f"timing off/{reduction}")


def ratio_cases():
    """Fewer bytes, measured: 1M elements against fp32 ring allreduce. Ideal ratios, bits per element
    b + (scale bits)/d: 4-bit d=512: 32/(4+32/512) = 7.88; 8-bit: 3.97; 1-bit two_mean d=64 (two
    float32 scales per bucket): 32/(1+64/64) = 16; allgather sends (N-1)/(2(N-1)/N) = N/2 times SRA's
    bytes. The thresholds leave room for the 64-byte headers (one per chunk)."""
    coll = _backend.collectives()
    n = 1 << 20
    for spec, reduction, at_least in (("qsgd:bits=4,bucket_size=512", "sra", 7.8),
                                      ("qsgd:bits=8,bucket_size=512", "sra", 3.9),
                                      ("onebit:bucket_size=64", "sra", 15.9),
                                      ("qsgd:bits=4,bucket_size=512", "allgather", 7.8 * 2 / N)):
        log = []
        ex = Exchange(hvd_quant.from_spec(spec), counting(coll, log), OPS, reduction=reduction)
        x = torch.randn(n, device=DEVICE)
        ex.finish(ex.start(f"ratio.{spec}.{reduction}", x, step=0))
        sent = 0
        for kind, v in log:
            sent += (sum(v) - v[R]) if kind == "alltoall" else (N - 1) * v
        fp32 = 2 * (N - 1) / N * 4 * n
        check(fp32 / sent >= at_least and sent == ex.traffic.sent_bytes,
              f"fewer bytes {spec}/{reduction}", f"{fp32 / sent:.2f}x fewer than fp32 (>= {at_least})")


def nan_cases():
    coll = _backend.collectives()
    for key in ("qsgd4_det", "qsgd4_sto", "onebit", "sortquant4_det", "kmeans4_b128", "fp16", "none"):
        for reduction in ("sra", "allgather"):
            n, at = 3000, 1234
            xs = inputs(n, 99, nan_at=at)
            ex = Exchange(hvd_quant.from_spec(SPECS[key]), coll, OPS, reduction=reduction)
            got = ex.finish(ex.start(f"nan.{key}.{reduction}", xs[R].clone().to(DEVICE), step=0)).cpu()
            ref = hvd.allreduce(xs[R].clone().to(DEVICE), op=hvd.Sum, name=f"nanref.{key}.{reduction}").cpu()
            check(bool(torch.isnan(got[at])) and bool(torch.isnan(ref[at])), f"nan {key}/{reduction}",
                  f"result[{at}]={float(got[at])}, fp32 allreduce={float(ref[at])}")
            check(same_on_all_ranks(got), f"nan identical {key}/{reduction}")


def error_cases():
    """Misconfigured ranks: every rank raises, quickly, with a message saying what is wrong."""
    coll = _backend.collectives()
    for reduction in ("sra", "allgather"):
        spec = SPECS["qsgd4_det"]
        # 1. another size under the same name
        ex = Exchange(hvd_quant.from_spec(spec), coll, OPS, reduction=reduction)
        n = 1000 + 2000 * R
        t0 = time.perf_counter()
        try:
            ex.finish(ex.start(f"bad.size.{reduction}", torch.randn(n, device=DEVICE), step=0))
            msg = None
        except (PayloadMismatchError, ValueError) as e:
            msg = str(e)
        dt = time.perf_counter() - t0
        ok = msg is not None and ("expected" in msg or "refused" in msg)
        check(all_ranks_true(ok) and dt < 10, f"size mismatch raises/{reduction}",
              f"{dt:.2f}s: {msg!r}"[:300])
        # 2. another tensor's payload (same size, another header name)
        ex = Exchange(hvd_quant.from_spec(spec), coll, OPS, reduction=reduction)
        t0 = time.perf_counter()
        try:
            ex.finish(ex.start(f"bad.name.{reduction}", torch.randn(4096, device=DEVICE), step=0,
                               header=f"tensor-of-rank-{R}"))
            msg = None
        except Exception as e:      # the codec's PayloadError (a ValueError)
            msg = f"{type(e).__name__}: {e}"
        dt = time.perf_counter() - t0
        check(all_ranks_true(msg is not None and "name" in msg.lower()) and dt < 10,
              f"wrong tensor raises/{reduction}", f"{dt:.2f}s: {msg!r}"[:300])
        # 3. another configuration, caught by the handshake before anything is decoded
        bits = 4 if R == 0 else 8
        ex = Exchange(hvd_quant.QSGD(bits=bits, bucket_size=512), coll, OPS, reduction=reduction)
        t0 = time.perf_counter()
        try:
            ex.finish(ex.start(f"bad.cfg.{reduction}", torch.randn(4096, device=DEVICE), step=0,
                               record=handshake_record(ex.codec.spec())))
            msg = None
        except ConfigMismatchError as e:
            msg = str(e)
        dt = time.perf_counter() - t0
        ok = msg is not None and "configured differently" in msg and "bits=4" in msg and "bits=8" in msg
        check(all_ranks_true(ok) and dt < 10, f"config mismatch raises/{reduction}",
              f"{dt:.2f}s: {msg!r}"[:400])


def main():
    check.run("exchange", exchange_cases)
    check.run("ratio", ratio_cases)
    check.run("bandwidth", bandwidth_cases)
    check.run("nan", nan_cases)
    check.run("errors", error_cases)
    check.finish()


if __name__ == "__main__":
    main()
