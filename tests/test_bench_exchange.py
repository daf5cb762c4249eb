"""``python -m hvd_quant.bench exchange`` for real on 2 Gloo ranks, small sizes: every default codec
(QSGD at 16, 12, 10, 8, 4 and 2 bits, 1-bit) and reduction gives a row with its bytes and the
effective GB/s of its collectives, printed and in the JSON."""
import json
import math
import sys

import pytest

from launch import ROOT, run_horovod

sys.path.insert(0, str(ROOT))

from hvd_quant.bench import exchange  # noqa: E402

pytestmark = [pytest.mark.multiproc, pytest.mark.torch]


def test_default_codecs_include_the_studys_qsgd_widths():
    bits = {int(s.split("bits=")[1].split(",")[0]) for s in exchange.DEFAULT_CODECS if s.startswith("qsgd")}
    assert {16, 12, 10, 8, 4, 2} <= bits


def test_exchange_bench_prints_gbps(tmp_path):
    """Two of the default codecs (a QSGD width and 1-bit; the codecs themselves are tested on real
    collectives in test_exchange_multiproc.py) under both reductions, beside fp32."""
    out = tmp_path / "rows.json"
    script = tmp_path / "bench.py"
    script.write_text("import sys\nfrom hvd_quant.bench.exchange import main\nsys.exit(main(sys.argv[1:]))\n")
    codecs = [c for c in exchange.DEFAULT_CODECS if c.startswith(("qsgd:bits=4,", "onebit:"))]
    assert len(codecs) == 2, exchange.DEFAULT_CODECS
    result = run_horovod(script, np=2, controller="gloo", timeout=400,
                         args=["--sizes", "tiny=3e4", "--iters", "2", "--warmup", "1", "--json", out,
                               "--codecs", ";".join(codecs)])
    assert "a2a GB/s" in result.stdout and "ag GB/s" in result.stdout, result.stdout[-3000:]
    rows = json.loads(out.read_text())["rows"]
    methods = {r["method"] for r in rows}
    assert methods == {"fp32 allreduce"} | {f"{red} {spec}" for red in exchange.DEFAULT_REDUCTIONS
                                            for spec in codecs}
    for r in rows:
        assert r["gbps"] > 0 and math.isfinite(r["gbps"]), r
        if r["method"].startswith("sra "):
            assert r["gbps_alltoall"] > 0 and r["gbps_allgather"] > 0, r
        elif r["method"].startswith("allgather "):
            assert r["gbps_alltoall"] is None and r["gbps_allgather"] == r["gbps"], r
