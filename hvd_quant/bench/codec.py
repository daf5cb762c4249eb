"""Benchmark: codec encode / decode / encode+decode beside the memory-bound limit and plain PyTorch.

    python -m hvd_quant.bench codec                       # GPU if there is one: 100M fp32, bucket 512
    python -m hvd_quant.bench codec --device cpu --numel 10000000 --threads 1,2
    python -m hvd_quant.bench codec --device cpu --codecs all      # every QSGD width and 1-bit

In one run it times, on the same float32 data:

* ``qsgd4``, ``qsgd8``, ``qsgd2`` (the default set; ``--codecs`` may name any ``qsgdN``, N in 2..16,
  or ``all``): QSGD stochastic, max norm, ``--bucket-size``; ``onebit``: 1-bit two_mean with the same
  bucket size; ``sortquant2``, ``sortquant4``, ``sortquant6``, ``sortquant8``: SortQuant stochastic
  with split_bits 1, 2, 3, 2 (the source's settings) and the same bucket size; ``kmeans2``, ``kmeans4``,
  ``kmeans6``, ``kmeans8``: KMeans with 20 iterations and one codebook per tensor. ``encode`` is
  ``codec.encode(x)``, ``decode`` is ``codec.decode_into(payload, out)`` (what the exchange calls),
  ``enc+dec`` both.
* ``copy``: a device copy of x into a preallocated buffer (reads and writes 4 bytes per element):
  the memory-bound limit (an encode+decode reads x, writes the payload, reads it, writes out).
* ``torch-ops``: the same bucketed QSGD (and 1-bit) written with plain PyTorch tensor ops
  (:func:`torch_qsgd_encode` ...), not bit-identical to ours (its own RNG), same work.

GPU: times are CUDA-event times of the GPU work only (a ``torch.cuda._sleep`` of ~20 ms before each
timed call keeps the GPU busy while the host enqueues it; the host time per call, i.e. the Python +
launch overhead, is reported separately as ``host ms/call``), median
of ``--repeat`` after ``--warmup`` calls. The first call of each codec (Numba compilation or cache
load included) is timed on its own. CPU: wall time, median, and GB/s of float32 input per core.
Ratios: ``enc / copy``, ``dec / copy``, ``enc+dec / copy`` and ``enc+dec / limit`` (lower is better;
the copy moves the same float32 data; the limit is the traffic of an
encode+decode, 8 + 2*B bytes per element for a payload of B bytes per element, at the copy's measured
rate: 1.0 = memory-bound), ``torch-ops / ours`` (higher is better).

``tiny enc+dec us``: wall time per ``decode_into(encode(x))`` call on a tiny tensor
(``--tiny-numel``, 4096 elements), many calls back to back then one synchronisation: the per-call
host cost (Python + kernel launches), which the large-tensor GPU times do not show. The rows of this
column are timed together after the others, taking turns for 5 rounds, each keeping its best.

On CUDA each configuration takes the kernel path ``numba_kernels.cuda.kernel_path`` selects (``warp``
or ``block``, the general path); the table's heading says which for the benchmarked bucket size.
"""
import argparse
import json
import statistics
import time

import numpy as np

CODECS = (("qsgd4", "qsgd:bits=4,bucket_size={bs}"), ("qsgd8", "qsgd:bits=8,bucket_size={bs}"),
          ("qsgd2", "qsgd:bits=2,bucket_size={bs}"), ("onebit", "onebit:bucket_size={bs}"))
WIDTHS = tuple(f"qsgd{b}" for b in range(2, 17))     # any of these may be named in --codecs
# SortQuant at the source's settings (bits = split + level bits): 2 = 1+1, 4 = 2+2, 6 = 3+3, 8 = 2+6
SORTQUANT = tuple((f"sortquant{b}", f"sortquant:bits={b},split_bits={s},bucket_size={{bs}}")
                  for b, s in ((2, 1), (4, 2), (6, 3), (8, 2)))
# KMeans as the source ran it: one codebook per tensor, 20 Lloyd iterations
KMEANS = tuple((f"kmeans{b}", f"kmeans:bits={b},iters=20") for b in (2, 4, 6, 8))
NAMED = CODECS + SORTQUANT + KMEANS


def codec_specs(names):
    """[(name, spec template)] for the ``names`` (separated by commas, or by semicolons when a spec
    string with commas is among them): the default set, ``qsgdN`` for any width N in 2..16, ``all``
    (every width, onebit, the SortQuant and KMeans rows), ``sortquant2`` / 4 / 6 / 8, ``kmeans2`` / 4 /
    6 / 8, or any codec spec string
    (``qsgd:bits=5,mode=deterministic``, ``fp16``), named by itself."""
    known = dict(NAMED)
    known.update((w, f"qsgd:bits={w[4:]},bucket_size={{bs}}") for w in WIDTHS)
    wanted = []
    for name in names.split(";" if ";" in names or ":" in names else ","):
        for one in (WIDTHS + ("onebit",) + tuple(n for n, _ in SORTQUANT + KMEANS) if name == "all" else (name,)):
            if one not in known:
                from hvd_quant import from_spec
                try:
                    from_spec(one)
                except ValueError as e:
                    raise SystemExit(f"unknown codec {one!r} ({e}); known: "
                                     f"{', '.join(n for n, _ in NAMED)}, qsgd2 .. qsgd16, "
                                     "all, or a codec spec string") from None
                known[one] = one.replace("{", "{{").replace("}", "}}")
            if one not in wanted:
                wanted.append(one)
    return [(n, known[n]) for n in wanted]


def build_parser():
    p = argparse.ArgumentParser(prog="python -m hvd_quant.bench codec", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--numel", type=float, default=None, help="elements (default 1e8 on cuda, 1e7 on cpu)")
    p.add_argument("--bucket-size", type=int, default=512)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if available")
    p.add_argument("--repeat", type=int, default=None, help="timed calls (default 20 cuda, 5 cpu)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", default=None, help="CPU: comma-separated Numba/torch thread counts")
    p.add_argument("--codecs", default=",".join(n for n, _ in CODECS),
                   help="comma-separated: " + ",".join(n for n, _ in CODECS) + ", qsgd2 .. qsgd16, all, "
                   "or codec spec strings (then separated by semicolons; no plain-PyTorch row for those)")
    p.add_argument("--no-torch-ops", action="store_true", help="skip the plain-PyTorch baseline")
    p.add_argument("--tiny-numel", type=int, default=4096,
                   help="elements of the tensor for the per-call host overhead column (0: skip)")
    p.add_argument("--tiny-calls", type=int, default=300, help="calls timed for that column")
    p.add_argument("--json", default=None, help="also write the rows as JSON here")
    return p


# ---- the same bucketed QSGD and 1-bit, in plain PyTorch -------------------------------------------------

def torch_qsgd_encode(x, bits, bucket_size):
    """Bucketed stochastic QSGD (max norm) with torch ops; codes packed 8/bits per byte (bits 2, 4, 8)."""
    import torch
    n = x.numel()
    nb = -(-n // bucket_size)
    xb = torch.nn.functional.pad(x, (0, nb * bucket_size - n)).view(nb, bucket_size)
    s = (1 << (bits - 1)) - 1
    scale = xb.abs().amax(dim=1, keepdim=True)
    unit = scale / s
    v = torch.where(unit > 0, xb.abs() / unit, torch.zeros_like(xb))
    q = torch.floor(v + torch.rand_like(v)).clamp_(max=s)
    code = (torch.where(xb < 0, -q, q) + s).to(torch.uint8).view(-1)
    per = 8 // bits
    if per > 1:
        shifts = torch.arange(per, device=x.device, dtype=torch.uint8) * bits
        code = (code.view(-1, per) << shifts).sum(dim=1, dtype=torch.uint8)
    return code, scale.view(-1)


def torch_qsgd_decode(code, scale, bits, bucket_size, n, out):
    import torch
    s = (1 << (bits - 1)) - 1
    per = 8 // bits
    if per > 1:
        shifts = torch.arange(per, device=code.device, dtype=torch.uint8) * bits
        code = ((code.view(-1, 1) >> shifts) & ((1 << bits) - 1)).view(-1)
    nb = scale.numel()
    vals = (code.view(nb, bucket_size).to(torch.float32) - s) * (scale / s).view(nb, 1)
    out.copy_(vals.view(-1)[:n])


def torch_onebit_encode(x, bucket_size):
    import torch
    n = x.numel()
    nb = -(-n // bucket_size)
    xb = torch.nn.functional.pad(x, (0, nb * bucket_size - n)).view(nb, bucket_size)
    pos = xb >= 0
    npos = pos.sum(1)
    mpos = torch.where(pos, xb, 0).sum(1) / npos.clamp(min=1)
    mneg = torch.where(pos, 0, xb).sum(1) / (bucket_size - npos).clamp(min=1)
    bits = pos.view(-1, 8).to(torch.uint8) << torch.arange(8, device=x.device, dtype=torch.uint8)
    return bits.sum(1, dtype=torch.uint8), torch.stack([mpos, mneg], 1)


def torch_onebit_decode(code, scales, bucket_size, n, out):
    import torch
    bits = (code.view(-1, 1) >> torch.arange(8, device=code.device, dtype=torch.uint8)) & 1
    nb = scales.shape[0]
    vals = torch.where(bits.view(nb, bucket_size).bool(), scales[:, :1], scales[:, 1:])
    out.copy_(vals.view(-1)[:n])


def _torch_ops(name, bucket_size):
    """(encode(x) -> state, decode(state, out)) for the plain-PyTorch twin of codec ``name``."""
    if name == "onebit":
        return (lambda x: torch_onebit_encode(x, bucket_size),
                lambda st, out: torch_onebit_decode(st[0], st[1], bucket_size, out.numel(), out))
    bits = int(name[4:])
    return (lambda x: torch_qsgd_encode(x, bits, bucket_size),
            lambda st, out: torch_qsgd_decode(st[0], st[1], bits, bucket_size, out.numel(), out))


# ---- timing -----------------------------------------------------------------------------------------------

class GpuTimer:
    def __init__(self, torch):
        self.torch = torch
        self._sleep = int(4e7)          # ~20 ms of GPU cycles: the GPU stays busy while we enqueue

    def __call__(self, fn, repeat, warmup):
        torch = self.torch
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        pairs, host = [], []
        for _ in range(repeat):
            torch.cuda._sleep(self._sleep)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            fn()
            b.record()
            host.append(time.perf_counter() - t0)
            pairs.append((a, b))
            torch.cuda.synchronize()
        gpu = [a.elapsed_time(b) for a, b in pairs]
        return statistics.median(gpu), 1e3 * statistics.median(host)

    def first(self, fn):
        self.torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        self.torch.cuda.synchronize()
        return time.perf_counter() - t0


class CpuTimer:
    def __call__(self, fn, repeat, warmup):
        for _ in range(warmup):
            fn()
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        m = 1e3 * statistics.median(ts)
        return m, m

    def first(self, fn):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0


def tiny_overhead_us(fns, calls, sync, rounds=5):
    """Wall time per call (µs) of each of ``fns``, ``calls`` calls back to back then one ``sync``:
    for a tiny tensor this is the host cost of a call (Python, adapters, kernel launches). The
    functions take turns, ``rounds`` times, and each keeps its best round, so that a slow stretch
    of the host (clock ramps, another process) does not fall on one row alone."""
    for fn in fns:
        for _ in range(max(3, calls // 10)):
            fn()
    sync()
    best = [None] * len(fns)
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            t = (time.perf_counter() - t0) / calls * 1e6
            best[i] = t if best[i] is None else min(best[i], t)
    return best


def _fmt(v, nd=3):
    return "-" if v is None else f"{v:.{nd}f}"


def run_device(args, device, threads=None):
    import hvd_quant as hq
    torch = None
    try:
        import torch
    except ImportError:
        if device == "cuda":
            raise
    n = int(args.numel)
    bs = args.bucket_size
    if device == "cuda":
        timer = GpuTimer(torch)
        x = torch.randn(n, device="cuda")
        out = torch.empty_like(x)
        copy = lambda: out.copy_(x)                    # noqa: E731
    else:
        import numba
        if threads:
            numba.set_num_threads(threads)
            if torch is not None:
                torch.set_num_threads(threads)
        timer = CpuTimer()
        x = np.random.default_rng(0).standard_normal(n, dtype=np.float32)
        out = np.empty_like(x)
        copy = lambda: np.copyto(out, x)               # noqa: E731
    rows = []
    tiny = int(getattr(args, "tiny_numel", 0) or 0)
    calls = int(getattr(args, "tiny_calls", 300))
    if tiny:
        if device == "cuda":
            xs = torch.randn(tiny, device="cuda")
            sync = torch.cuda.synchronize
        else:
            xs = np.random.default_rng(1).standard_normal(tiny, dtype=np.float32)
            sync = lambda: None                        # noqa: E731
        outs = xs * 0
    cp, cp_host = timer(copy, args.repeat, args.warmup)
    rows.append(dict(codec="copy", spec="memcpy", encode=None, decode=None, encdec=cp, host=cp_host,
                     bytes_per_elem=4.0))
    tiny_fns = []           # (row, fn): timed together at the end (tiny_overhead_us)
    if tiny:
        tiny_fns.append((rows[0], (lambda: outs.copy_(xs)) if device == "cuda"
                         else (lambda: np.copyto(outs, xs))))
    for name, spec in codec_specs(args.codecs):
        c = hq.from_spec(spec.format(bs=bs))
        first_enc = timer.first(lambda: c.encode(x))
        p = c.encode(x)
        first_dec = timer.first(lambda: c.decode_into(p, out))
        enc, enc_host = timer(lambda: c.encode(x), args.repeat, args.warmup)
        dec, dec_host = timer(lambda: c.decode_into(p, out), args.repeat, args.warmup)
        ed, ed_host = timer(lambda: c.decode_into(c.encode(x), out), args.repeat, args.warmup)
        row = dict(codec=name, spec=c.spec(), encode=enc, decode=dec, encdec=ed, host=ed_host,
                   first_encode_s=first_enc, first_decode_s=first_dec,
                   bytes_per_elem=c.wire_nbytes(n) / n)
        if tiny:
            tiny_fns.append((row, lambda c=c: c.decode_into(c.encode(xs), outs)))
        if torch is not None and not args.no_torch_ops and (name in WIDTHS or name == "onebit"):
            xt = x if device == "cuda" else torch.from_numpy(x)
            ot = out if device == "cuda" else torch.from_numpy(out)
            t_enc, t_dec = _torch_ops(name, bs)
            st = t_enc(xt)
            row["torch_encode"] = timer(lambda: t_enc(xt), args.repeat, args.warmup)[0]
            row["torch_decode"] = timer(lambda: t_dec(st, ot), args.repeat, args.warmup)[0]
            row["torch_encdec"] = timer(lambda: t_dec(t_enc(xt), ot), args.repeat, args.warmup)[0]
        rows.append(row)
    if tiny_fns:
        for (row, _), us in zip(tiny_fns, tiny_overhead_us([f for _, f in tiny_fns], calls, sync)):
            row["tiny_us"] = us
    return rows


def kernel_paths(bucket_size, numel):
    """The CUDA kernel paths of 4-bit QSGD and 1-bit at this bucket size ('warp' or 'block')."""
    import numba_kernels.cuda as K
    return f"qsgd-4 {K.kernel_path(4, bucket_size, numel)}, onebit {K.kernel_path(1, bucket_size, numel)}"


def traffic_limit(copy_ms, row):
    """The memory-bound time of ``row``'s encode+decode: its traffic (read x, write the payload, read
    it, write out: 8 + 2*B bytes per element; the copy's own row: 8) at the copy's measured rate
    (8 bytes per element in ``copy_ms``)."""
    if row["codec"] == "copy":
        return copy_ms
    return copy_ms * (8 + 2 * row["bytes_per_elem"]) / 8


def print_table(rows, device, numel, threads=None, impl=None, tiny=None):
    cp = rows[0]["encdec"]
    head = f"{device}, numel={numel:,}" + (f", threads={threads}" if threads else "")
    if impl:
        head += f", CUDA kernel paths: {impl}"
    print(f"\n### {head}\n")
    cols = ["codec", "B/elem", "encode ms", "decode ms", "enc+dec ms", "enc / copy", "dec / copy",
            "enc+dec / copy",
            "enc+dec / limit", "torch-ops enc+dec ms", "torch-ops / ours", "host ms/call", "first enc s",
            "first dec s", "tiny enc+dec us"]
    if device == "cpu":
        cols += ["enc GB/s/core", "dec GB/s/core", "enc+dec GB/s/core"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        ted = r.get("torch_encdec")
        cells = [r["codec"], _fmt(r["bytes_per_elem"], 3), _fmt(r["encode"]), _fmt(r["decode"]),
                 _fmt(r["encdec"]), _fmt(r["encode"] / cp if r["encode"] else None, 2),
                 _fmt(r["decode"] / cp if r["decode"] else None, 2), _fmt(r["encdec"] / cp, 2),
                 _fmt(r["encdec"] / traffic_limit(cp, r), 2), _fmt(ted),
                 _fmt(ted / r["encdec"] if ted else None, 1), _fmt(r["host"]),
                 _fmt(r.get("first_encode_s"), 2), _fmt(r.get("first_decode_s"), 2),
                 _fmt(r.get("tiny_us"), 1)]
        if device == "cpu":
            gb = lambda ms: None if ms is None else 4 * numel / (ms * 1e-3) / 1e9 / (threads or 1)  # noqa: E731
            cells += [_fmt(gb(r["encode"]), 2), _fmt(gb(r["decode"]), 2), _fmt(gb(r["encdec"]), 2)]
        print("| " + " | ".join(cells) + " |")
    if tiny and len(rows) > 1:
        parts = ", ".join(f"{r['codec']} {r['tiny_us']:.1f}" for r in rows if r.get("tiny_us") is not None)
        print(f"\nhost overhead (numel={tiny:,}, encode+decode_into per call, us): {parts}")


def main(argv=None):
    args = build_parser().parse_args(argv)
    codec_specs(args.codecs)                        # a misspelt name fails before anything runs
    device = args.device
    if device is None:
        try:
            import torch
            device = "cuda" if torch.cuda.is_available() else "cpu"
        except ImportError:
            device = "cpu"
    if args.numel is None:
        args.numel = 1e8 if device == "cuda" else 1e7
    if args.repeat is None:
        args.repeat = 20 if device == "cuda" else 5
    n = int(args.numel)
    print(f"hvd_quant codec benchmark: device={device} numel={n:,} bucket_size={args.bucket_size} "
          f"repeat={args.repeat} warmup={args.warmup}")
    impl = None
    if device == "cuda":
        import torch
        import numba
        impl = kernel_paths(args.bucket_size, n)
        print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, numba {numba.__version__}, "
              f"CUDA kernel paths: {impl}")
    out = []
    for t in ([int(t) for t in args.threads.split(",")] if (args.threads and device == "cpu") else [None]):
        rows = run_device(args, device, t)
        print_table(rows, device, n, t, impl, args.tiny_numel)
        out.append(dict(device=device, numel=n, threads=t, kernels=impl, rows=rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
