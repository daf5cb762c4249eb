"""``python -m hvd_quant.bench train`` for real on CPU: Gloo jobs under horovodrun, the CSV, resume,
``--only``, a failed method, a timed-out job, the one-process and DDP peers; no mocks (the driver runs
in this process, every configuration is a real subprocess)."""
import csv
import gzip
import json
import os
import sys

import pytest

from launch import ROOT, horovod_env

sys.path.insert(0, str(ROOT))

from hvd_quant.bench import train  # noqa: E402
from hvd_quant.bench._train_worker import parse_method  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]

TINY = ["--device", "cpu", "--np", "2", "--models", "mlp", "--image-size", "8", "--batch-size", "8",
        "--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", "2",
        "--threads", "1", "--timeout", "150", "--no-plot"]


@pytest.fixture
def job_env(monkeypatch):
    """The environment the other multi-process tests give their jobs (threads, stall checks, paths)."""
    for k, v in horovod_env().items():
        if os.environ.get(k) != v:
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("PATH", os.pathsep.join([os.path.dirname(sys.executable), os.environ["PATH"]]))


def rows_of(out):
    with open(out / "train.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return {r["id"]: r for r in rows}, rows


def test_method_ids():
    assert parse_method("hvdq-qsgd4-auto")["reduction"] == "auto"       # passed through
    assert parse_method("ddp-powersgd4")["rank"] == 4
    assert parse_method("stock-onebit")["launcher"] == "horovod"
    for bad in ("hvdq-qsgd5-sra", "stock-fp8", "ddp-powersgd0", "nosuch"):
        with pytest.raises(ValueError):
            parse_method(bad)
    assert train.last_error("[1]<stderr>:Traceback\n[1]<stderr>:ValueError: bad thing\n"
                            "RuntimeError: Horovod detected that one or more processes exited\n") \
        == "ValueError: bad thing"
    # both launchers' prefixes: Gloo's [rank] and Open MPI's [job,rank]
    for prefix in ("[0]<stdout>:", "[1,0]<stdout>:"):
        assert train.parse_result(f"{prefix}Iter #0\n{prefix}{train.RESULT_PREFIX}" '{"a": 1}\n') == {"a": 1}
    assert train.last_error("[1,1]<stderr>:KeyError: 'x'\n") == "KeyError: 'x'"


def test_repeat_reports_the_median_job_and_alternates_the_order():
    def row(method, v, status="ok", replicas="identical"):
        return dict(id=f"m/n/{method}", np="2", method=method, model="m", network="n", status=status,
                    img_per_sec=str(v), replicas=replicas)
    rows = [row("a", 5), row("b", 10), row("a", 9), row("b", 30), row("a", 7), row("b", 20),
            row("b", 0, "failed")]
    one = train.current(rows)
    assert one[("m/n/a", "2")]["img_per_sec"] == "7" and one[("m/n/b", "2")]["status"] == "failed"
    three = train.current(rows, 3)
    a, b = three[("m/n/a", "2")], three[("m/n/b", "2")]
    assert (a["img_per_sec"], a["runs"], a["low"], a["high"]) == ("7", "3/3", "5", "9")
    assert (b["img_per_sec"], b["runs"], b["low"], b["high"]) == ("20", "2/3", "20", "30")  # lower median
    assert train.current([row("a", 1), row("a", 2, replicas="DIFFER")], 2)[("m/n/a", "2")]["replicas"] \
        == "DIFFER"                                          # a differing job is never hidden by the median
    c = [train.Config("m", "n", x, 2) for x in "xyz"]
    order = train.run_order(c, {c[0].key: 3, c[1].key: 1, c[2].key: 2})
    assert [x.method for x in order] == ["x", "y", "z", "z", "x", "x"]


def test_trace_timeline_switch(tmp_path):
    """--trace asks the job for Horovod's timeline (HOROVOD_TIMELINE) unless --no-timeline."""
    for extra, timeline in (([], "DYNAMIC"), (["--no-timeline"], None)):
        args = train.resolve(train.build_parser().parse_args(
            TINY + ["--methods", "hvd-fp32", "--out", str(tmp_path), "--trace"] + extra))
        (cfg,) = train.plan(args)
        argv, env = train.command(cfg, args)
        assert "--trace" in argv and env.get("HOROVOD_TIMELINE") == timeline, (extra, env)


def test_onebit_adam_method_on_the_slow_link(tmp_path):
    """onebit-adam is a Horovod method; --slownet starts each Horovod job through scripts/slownet.py
    (which starts the ranks), labelled by its rate; --optimizer reaches the worker."""
    args = train.resolve(train.build_parser().parse_args(
        TINY + ["--methods", "hvd-fp32,onebit-adam", "--optimizer", "adam", "--slownet", "1gbit",
                "--out", str(tmp_path)]))
    for cfg in train.plan(args):
        argv, _ = train.command(cfg, args)
        assert cfg.id.startswith("mlp/slownet-1gbit/") and cfg.spec["launcher"] == "horovod", cfg.id
        assert argv[1].endswith("scripts/slownet.py") and argv[argv.index("--rate") + 1] == "1gbit", argv
        assert "horovodrun" not in " ".join(argv) and argv[argv.index("--optimizer") + 1] == "adam", argv


def test_ddp_methods_on_the_slow_link(tmp_path):
    """--slownet starts DDP jobs through scripts/slownet.py --torch (torch.distributed ranks, env://),
    not torchrun, which would put both ranks on one namespace's loopback; --slownet-prefix names its
    namespaces (two runs at once would tear down each other's)."""
    args = train.resolve(train.build_parser().parse_args(
        TINY + ["--methods", "ddp-fp32,ddp-powersgd4,ddpq-qsgd4-sra", "--slownet", "1gbit", "--slownet-prefix", "dd",
                "--out", str(tmp_path)]))
    for cfg in train.plan(args):
        argv, _ = train.command(cfg, args)
        assert cfg.id.startswith("mlp/slownet-1gbit/") and cfg.spec["launcher"] == "ddp", cfg.id
        assert argv[1].endswith("scripts/slownet.py") and "--torch" in argv[:argv.index("--")], argv
        assert "torch.distributed.run" not in argv and argv[argv.index("--method") + 1] == cfg.method, argv
        assert argv[argv.index("--prefix") + 1] == "dd", argv


def test_train_driver_cpu(tmp_path, job_env, capsys):
    out = tmp_path / "bench"
    methods = ["--methods", "hvd-fp32,hvdq-qsgd4-allgather,hvdq-qsgd5-sra"]
    # 1. --only: the fp32 peer and the method the driver rejects; the compressed config waits
    rc = train.main(TINY + methods + ["--out", str(out), "--only", "*/hvd-fp32,*/hvdq-qsgd5*"])
    text = capsys.readouterr().out
    assert rc == 1, text                                   # one config failed; the run went on
    by_id, rows = rows_of(out)
    assert set(by_id) == {"mlp/loopback/hvd-fp32", "mlp/loopback/hvdq-qsgd5-sra"}, text
    fp32 = by_id["mlp/loopback/hvd-fp32"]
    assert fp32["status"] == "ok" and float(fp32["img_per_sec"]) > 0, text
    assert float(fp32["vs_best_peer"]) == pytest.approx(1.0) and fp32["best_peer"] == "hvd-fp32"
    assert fp32["np"] == "2" and "horovodrun" in fp32["command"] and "--gloo" in fp32["command"]
    assert (out / fp32["log"]).exists()
    assert "Iter #1:" in (out / fp32["log"]).read_text()
    bad = by_id["mlp/loopback/hvdq-qsgd5-sra"]
    assert bad["status"] == "failed" and "unknown method" in bad["error"]

    # 2. everything: hvd-fp32 is resumed from the CSV, the compressed config runs, traced
    rc = train.main(TINY + ["--methods", "hvd-fp32,hvdq-qsgd4-allgather", "--out", str(out), "--trace"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "skip mlp/loopback/hvd-fp32" in text
    by_id, rows = rows_of(out)
    assert [r["id"] for r in rows].count("mlp/loopback/hvd-fp32") == 1         # not run again
    q = by_id["mlp/loopback/hvdq-qsgd4-allgather"]
    assert q["status"] == "ok" and float(q["img_per_sec"]) > 0, q
    assert q["best_peer"] == "hvd-fp32" and float(q["vs_best_peer"]) == pytest.approx(
        float(q["img_per_sec"]) / float(fp32["img_per_sec"]), rel=1e-3)
    assert float(q["bytes_ratio"]) > 2                 # 4-bit payloads: several times fewer bytes
    assert q["replicas"] == fp32["replicas"] == "identical", (q, fp32)
    assert "mlp/loopback/hvdq-qsgd4-allgather" in text.split("id ")[-1]          # the final table
    assert "chart" not in text                                                  # --no-plot
    stem = out / "traces" / "mlp__loopback__hvdq-qsgd4-allgather"
    for r in (0, 1):        # --trace: every rank's profile of 3 more steps, Horovod's timeline
        with gzip.open(f"{stem}.rank{r}.json.gz", "rt") as f:
            names = {e.get("name") for e in json.load(f)["traceEvents"]}
        assert {"train_step#0", "train_step#2"} <= names, sorted(map(str, names))[:20]
    assert "ALLGATHER" in open(f"{stem}.horovod.json").read()
    assert "Trace of 3 steps" in (out / q["log"]).read_text()
    capsys.readouterr()
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_trace       # the traces' reader: the last step, Horovod's activities, per tensor
    assert plot_trace.main([f"{stem}.rank0.json.gz", "--responses", "1e6"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("train_step#2: ") and "host " in text, text
    listing = text.split("last 1e+06 ms")[1].splitlines()[1:]
    assert any(" ALLGATHER " in line and ".ag." in line for line in listing), text   # our allgathers

    # 3. --repeat 2: hvd-fp32 has one ok job, so one more runs; its log beside the first one's
    rc = train.main(TINY + ["--methods", "hvd-fp32", "--out", str(out), "--repeat", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and "[1/1] mlp/loopback/hvd-fp32" in text, text
    _, rows = rows_of(out)
    runs = [r for r in rows if r["id"] == "mlp/loopback/hvd-fp32"]
    assert len(runs) == 2 and runs[0]["log"] != runs[1]["log"], runs
    assert all((out / r["log"]).exists() for r in runs)
    table = text.split("id ")[-1]
    assert "2/2" in table, table

    # 4. --list: both done now; --only narrows it
    train.main(TINY + ["--methods", "hvd-fp32,hvdq-qsgd4-allgather", "--out", str(out), "--list",
                       "--only", "*allgather"])
    listed = capsys.readouterr().out.strip().splitlines()
    assert listed == ["done  mlp/loopback/hvdq-qsgd4-allgather  N=2"], listed


def test_train_driver_timeout_and_chart_note(tmp_path, job_env, capsys):
    out = tmp_path / "bench"
    args = [a for a in TINY if a != "--no-plot"]
    args[args.index("--timeout") + 1] = "0.5"
    rc = train.main(args + ["--methods", "single", "--out", str(out), "--num-iters", "1000"])
    text = capsys.readouterr().out
    assert rc == 1
    by_id, _ = rows_of(out)
    assert by_id["mlp/local/single"]["status"] == "timeout", text
    # the only config timed out: nothing to draw, and the run says why (matplotlib is installed by
    # the bootstrap, so this is not the missing-matplotlib note)
    assert f"chart skipped: no ok rows in {out / 'train.csv'}" in text and not (out / "train.png").exists()


def _chart_csv(path):
    """A train.csv as the driver writes it: two ok methods and a failed one, one model and network."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "np", "method", "model", "network", "status", "img_per_sec", "replicas"])
        w.writerow(["m/n/hvd-fp32", 2, "hvd-fp32", "m", "n", "ok", 100.0, "identical"])
        w.writerow(["m/n/hvdq-qsgd4-sra", 2, "hvdq-qsgd4-sra", "m", "n", "ok", 150.0, "identical"])
        w.writerow(["m/n/hvdq-qsgd8-sra", 2, "hvdq-qsgd8-sra", "m", "n", "failed", "", ""])
    return path


def test_chart_is_drawn_or_says_why(tmp_path, monkeypatch, capsys):
    """With ok rows the chart is a PNG beside the CSV; without matplotlib the run says so and how to
    redraw it (--plot); no silent third outcome."""
    path = _chart_csv(tmp_path / "train.csv")
    png = train.plot(path)
    assert png == tmp_path / "train.png" and capsys.readouterr().out.strip() == f"chart: {png}"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000
    png.unlink()
    monkeypatch.setitem(sys.modules, "matplotlib", None)       # import matplotlib -> ImportError
    assert train.plot(path) is None and not png.exists()
    text = capsys.readouterr().out
    assert "chart skipped: matplotlib is missing" in text and f"--plot {path}" in text


def test_train_driver_ddp_and_single(tmp_path, job_env, capsys):
    out = tmp_path / "bench"
    rc = train.main(TINY + ["--methods", "single,ddp-fp16", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0, text
    by_id, _ = rows_of(out)
    single, ddp = by_id["mlp/local/single"], by_id["mlp/loopback/ddp-fp16"]
    assert single["procs"] == "1" and float(single["vs_single"]) == pytest.approx(1.0)
    assert single["replicas"] == "one" and ddp["replicas"] == "identical", (single, ddp)
    assert "torch.distributed.run" in ddp["command"] and ddp["best_peer"] == "ddp-fp16"
    assert float(ddp["vs_single"]) == pytest.approx(
        float(ddp["img_per_sec"]) / float(single["img_per_sec"]), rel=1e-3)


def test_plot_trace_launches(tmp_path, capsys):
    """plot_trace --launches pairs each hvd_quant / NCCL / Horovod kernel with the host call of the same
    correlation id (a hand-made trace: a step of 10 ms, an encode launched at 1 ms that ran at 4 ms,
    an allgather launched at 2 ms that ran at 6 ms, a compute kernel that is not listed)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_trace

    def x(name, cat, ts, dur, **args):
        return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": args}
    events = [x("train_step#0", "user_annotation", 1000, 10000),
              x("cuLaunchKernel", "cuda_driver", 2000, 10, correlation=1),
              x("cudaLaunchKernel", "cuda_runtime", 3000, 10, correlation=2),
              x("numba_kernels::warp_encode", "kernel", 5000, 300, correlation=1, stream=7),
              x("ncclDevKernel_AllGather_RING_LL", "kernel", 7000, 2000, correlation=2, stream=14),
              x("sm90_xmma_dgrad", "kernel", 4000, 900, correlation=3, stream=7)]
    path = tmp_path / "t.rank0.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert plot_trace.main([str(path), "--launches"]) == 0
    lines = capsys.readouterr().out.split("host launch -> GPU start")[1].splitlines()[1:]
    assert [line.split()[:5] for line in lines] == [["1.00", "->", "4.00", "0.30", "hvd_quant"],
                                                   ["2.00", "->", "6.00", "2.00", "nccl"]], lines


def test_plot_scaling_table(tmp_path, capsys):
    """plot_scaling: per model, network and N the fp32 row (`single` at N = 1, for every network), the
    `auto` row of a precision over its fixed ways, speedup over fp32 at the same N, scaling efficiency
    against N x `single`, and the QSGD paper's EC2 numbers beside them (hand-made CSVs)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    import plot_scaling
    rows = [("resnet50", "local", 1, "single", "ok", 100.0),
            ("resnet50", "sockets", 2, "hvd-fp32", "ok", 120.0),
            ("resnet50", "sockets", 2, "hvdq-qsgd4-sra", "ok", 190.0),
            ("resnet50", "sockets", 2, "hvdq-qsgd4-auto", "ok", 180.0),
            ("resnet50", "sockets", 2, "hvdq-qsgd8-allgather", "ok", 150.0),
            ("resnet50", "sockets", 2, "hvdq-qsgd8-sra", "ok", 160.0),
            ("resnet50", "sockets", 2, "hvdq-onebit-sra", "timeout", 999.0)]
    path = tmp_path / "train.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "model", "network", "np", "method", "status", "img_per_sec", "total_img_per_sec"])
        w.writerows([(f"{m}/{net}/{meth}", m, net, n, meth, st, rate / n, rate)
                     for m, net, n, meth, st, rate in rows])
    plot_scaling.main([str(path), "--out", str(tmp_path / "scaling.png")])
    table = [line.rstrip(" |").split(" | ") for line in capsys.readouterr().out.splitlines()
             if line.startswith("| resnet50")]
    got = {(r[1], r[2]): (r[3], r[4], r[5], r[6], r[7], r[8]) for r in table}
    assert got == {
        ("1", "32bit"): ("`single`", "100.0", "1.000", "1.00", "47.2", "1.00"),
        ("2", "32bit"): ("`hvd-fp32`", "120.0", "0.600", "1.00", "80.8", "1.00"),
        ("2", "qsgd4"): ("`hvdq-qsgd4-auto`", "180.0", "0.900", "1.50", "93.9", "1.16"),
        ("2", "qsgd8"): ("`hvdq-qsgd8-sra`", "160.0", "0.800", "1.33", "92.6", "1.15"),
    }, table
    assert (tmp_path / "scaling.png").stat().st_size > 0
