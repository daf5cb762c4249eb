"""The log lines of the runs we mirror, a metrics file of every number, and the progress bar.

Printed on rank 0 (the format of the torch.distributed logs in ``shared/reference/001_*``):

    Step200: 100.71 data/sec
    Epoch 0 in 543.88 sec, test time 13.77 sec, test accuracy:0.86263

``data/sec`` is samples per second over all ranks (per-rank batch x world size x steps), averaged
from the start of training to that step, with time spent in the test passes left out (the reference
figures rise slowly across a run the same way). Steps count optimizer steps from 1 across epochs.

``--metrics-out FILE`` gets every metric: JSON lines (``.jsonl`` / ``.json`` / anything else), one
object per event (``config``, ``step``, ``epoch``, ``summary``), or CSV (``.csv``) with the columns in
:data:`CSV_FIELDS` (the ``config`` event goes to the log only). A ``step`` record is written every ``--log-every``
steps and at the last step: cumulative and window data/sec, the mean loss since the previous record,
the learning rate, the last step's time.

:func:`parse_log` reads the lines back (also the published variants: ``Step 1600 60.44 data/sec``,
``. Test accuracy 0.9790``), for the tests and the sweep summary.

``--tensorboard DIR`` writes the same records as TensorBoard scalars (:data:`SCALARS`), one run
directory per model (``DIR/<model>``), through a writer the framework's example makes
(``torch.utils.tensorboard.SummaryWriter`` or a ``tf.summary`` one): loss, rate, learning rate, step
time, and what hvd_quant measured in the step (``hvd_quant.torch.step_metrics`` /
``hvd_quant.tensorflow.step_metrics``: bytes sent, the fp32 equivalent, the ratio, the exchange's time)
at every logged step; test accuracy and loss at every epoch.

Progress (rank 0 only, on stderr): on a terminal a live tqdm bar; anywhere else (``horovodrun``'s
prefixed pipes, CI, a file) no bar, which would come out as carriage-return fragments between log
lines, but one plain line every ``PROGRESS_EVERY`` seconds and at the end of each bar:

    resnet18 epoch 0: 120/440 steps (27%), 4.83 steps/s, 0:00:25 elapsed, ETA 0:01:06, loss 0.4121
"""
import csv
import json
import math
import os
import re
import sys
import time
from typing import Dict, List, Optional

STEP_RE = re.compile(r"Step\s*(\d+):?\s+([0-9]+(?:\.[0-9]+)?) data/sec")
EPOCH_RE = re.compile(r"Epoch (\d+) in ([0-9.]+) sec, test time ([0-9.]+) sec[,.]\s*"
                      r"(?:[Tt]?est accuracy):?\s*([0-9.]+|n/a)")
THROUGHPUT_RE = re.compile(r"Throughput: ([0-9.]+) data/sec over (\d+) ranks?")
MODEL_RE = re.compile(r"== model (\S+)")
PROGRESS_EVERY = 30.0   # seconds between progress lines when stderr is not a terminal

CSV_FIELDS = ("event", "model", "step", "epoch", "elapsed", "train_time", "data_per_sec",
              "window_data_per_sec", "step_time", "loss", "lr", "epoch_time", "test_time",
              "test_accuracy", "test_loss", "steps", "samples", "bench_data_per_sec",
              "bytes_sent_per_step", "bytes_fp32_per_step", "measured_bytes_sent", "measured_bytes_fp32",
              "measured_gbps", "compression_ratio", "exchange_s", "reduction")

# TensorBoard: record field -> scalar tag, per event
SCALARS = {
    "step": {"loss": "train/loss", "data_per_sec": "train/data_per_sec",
             "window_data_per_sec": "train/window_data_per_sec", "lr": "train/lr",
             "step_time": "train/step_time_s", "bytes_sent_per_step": "exchange/bytes_sent",
             "bytes_fp32_per_step": "exchange/bytes_fp32", "compression_ratio": "exchange/ratio",
             "exchange_s": "exchange/seconds"},
    "epoch": {"test_accuracy": "test/accuracy", "test_loss": "test/loss",
              "epoch_time": "train/epoch_time_s"},
}


def format_step(step: int, data_per_sec: float) -> str:
    return f"Step{step}: {data_per_sec:.2f} data/sec"


def format_epoch(epoch: int, epoch_time: float, test_time: float, accuracy: Optional[float]) -> str:
    acc = "n/a" if accuracy is None else f"{accuracy:.5f}"
    return f"Epoch {epoch} in {epoch_time:.2f} sec, test time {test_time:.2f} sec, test accuracy:{acc}"


def format_throughput(data_per_sec: float, world_size: int, steps: int, warmup: int) -> str:
    return (f"Throughput: {data_per_sec:.2f} data/sec over {world_size} rank{'s' if world_size != 1 else ''} "
            f"({data_per_sec / max(world_size, 1):.2f} per rank; {steps} steps after {warmup} warmup steps)")


def parse_log(text: str) -> Dict[str, Dict]:
    """``{model: {"steps": [(step, rate)], "epochs": [(epoch, time, test_time, acc)],
    "throughput": rate or None}}``; lines before any ``== model`` header go under ``""``."""
    out: Dict[str, Dict] = {}
    current = ""

    def entry(name):
        return out.setdefault(name, {"steps": [], "epochs": [], "throughput": None})

    for line in text.splitlines():
        m = MODEL_RE.search(line)
        if m:
            current = m.group(1)
            entry(current)
            continue
        m = STEP_RE.search(line)
        if m:
            entry(current)["steps"].append((int(m.group(1)), float(m.group(2))))
            continue
        m = EPOCH_RE.search(line)
        if m:
            acc = None if m.group(4) == "n/a" else float(m.group(4))
            entry(current)["epochs"].append((int(m.group(1)), float(m.group(2)), float(m.group(3)), acc))
            continue
        m = THROUGHPUT_RE.search(line)
        if m:
            entry(current)["throughput"] = float(m.group(1))
    return out


def read_metrics(path: str) -> List[Dict]:
    """Records of a metrics file written by :class:`RunLog` (JSON lines or CSV)."""
    with open(path, newline="") as f:
        if path.endswith(".csv"):
            rows = []
            for row in csv.DictReader(f):
                rows.append({k: _num(v) for k, v in row.items() if v != ""})
            return rows
        return [json.loads(line) for line in f if line.strip()]


def _num(text):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


class RunLog:
    """Rank-0 printing, the metrics file and the tqdm bar; other ranks stay silent.

    Call :meth:`step` after every optimizer step with the cumulative training time (test passes
    excluded); it prints the ``StepN`` line every ``log_every`` steps.
    """

    def __init__(self, rank: int, world_size: int, log_every: int = 200, metrics_out: Optional[str] = None,
                 progress: bool = True, stream=None, tensorboard=None):
        self.rank = rank
        self.world_size = world_size
        self.log_every = log_every
        self.stream = stream or sys.stdout
        self.progress = progress and rank == 0
        self.model = ""
        self._bar = None
        self._t0 = time.perf_counter()
        self._file = None
        self._csv = None
        self._window = (0, 0.0)  # (samples, train_time) at the last printed step
        self._make_writer = tensorboard if rank == 0 else None   # model name -> scalar writer
        self._writer = None
        if rank == 0 and metrics_out:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_out)), exist_ok=True)
            self._file = open(metrics_out, "w", newline="")
            if metrics_out.endswith(".csv"):
                self._csv = csv.DictWriter(self._file, fieldnames=CSV_FIELDS, extrasaction="ignore")
                self._csv.writeheader()

    # -- output
    def emit(self, line: str):
        if self.rank != 0:
            return
        if self._bar is not None and sys.stderr.isatty():  # same terminal: keep the bar below the line
            from tqdm import tqdm
            tqdm.write(line, file=self.stream)
        else:
            print(line, file=self.stream, flush=True)

    def record(self, event: str, **fields):
        self._scalars(event, fields)
        if self._file is None:
            return
        rec = {"event": event, "model": self.model, "elapsed": round(time.perf_counter() - self._t0, 4)}
        rec.update(fields)
        if self._csv is not None:
            if event != "config":
                self._csv.writerow(rec)
        else:
            self._file.write(json.dumps(rec, default=_jsonable) + "\n")
        self._file.flush()

    def _scalars(self, event: str, fields: dict):
        tags = SCALARS.get(event)
        if self._writer is None or tags is None:
            return
        step = fields.get("step", fields.get("steps", fields.get("epoch", 0)))
        for key, tag in tags.items():
            v = fields.get(key)
            if isinstance(v, (int, float)) and math.isfinite(v):
                self._writer.add_scalar(tag, float(v), int(step))
        self._writer.flush()

    # -- phases
    def start_model(self, name: str):
        self.model = name
        self._window = (0, 0.0)
        if self._make_writer is not None:
            self._close_writer()
            self._writer = self._make_writer(name)
        self.emit(f"== model {name}")

    def bar(self, total: int, desc: str):
        """Rank 0's progress (module doc): a tqdm bar on a terminal, else :class:`LineProgress`; a
        no-op object on other ranks or when disabled. Use as a context."""
        if self.progress and sys.stderr.isatty():
            from tqdm import tqdm
            bar = tqdm(total=total, desc=desc, file=sys.stderr, leave=False, dynamic_ncols=True,
                       mininterval=0.5)
        else:
            bar = LineProgress(total, desc, disable=not self.progress)
        self._bar = None if bar.disable else bar
        return _BarContext(self, bar)

    def step(self, step: int, epoch: int, samples: int, train_time: float, loss: Optional[float] = None,
             lr: Optional[float] = None, step_time: Optional[float] = None, record: bool = False,
             exchange: Optional[dict] = None):
        """``samples``: all ranks' samples so far; ``train_time``: seconds of training so far;
        ``exchange``: hvd_quant's ``step_metrics`` of this step, or None.
        Prints the ``StepN`` line every ``log_every`` steps; writes a ``step`` record then, or when
        ``record`` is true."""
        rate = samples / train_time if train_time > 0 else 0.0
        fields = {"step": step, "epoch": epoch, "samples": samples, "train_time": round(train_time, 6),
                  "data_per_sec": rate, "loss": loss, "lr": lr, "step_time": step_time}
        if exchange:
            fields.update(bytes_sent_per_step=exchange["sent"], bytes_fp32_per_step=exchange["fp32"],
                          compression_ratio=exchange["ratio"], exchange_s=exchange["exchange_s"],
                          reduction=exchange["reduction"])
        if step % self.log_every == 0:
            s0, t0 = self._window
            fields["window_data_per_sec"] = (samples - s0) / (train_time - t0) if train_time > t0 else 0.0
            self._window = (samples, train_time)
            self.emit(format_step(step, rate))
            record = True
        if record:
            self.record("step", **fields)
        if self._bar is not None:
            self._bar.update(1)
            if loss is not None:
                self._bar.set_postfix(loss=f"{loss:.4f}", refresh=False)

    def epoch(self, epoch: int, epoch_time: float, test_time: float, accuracy: Optional[float],
              **extra):
        self.emit(format_epoch(epoch, epoch_time, test_time, accuracy))
        self.record("epoch", epoch=epoch, epoch_time=epoch_time, test_time=test_time,
                    test_accuracy=accuracy, **extra)

    def _close_writer(self):
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def close(self):
        self._close_writer()
        if self._file is not None:
            self._file.close()
            self._file = None


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class LineProgress:
    """The progress bar's interface (``update``, ``set_postfix``, ``close``) as whole lines on
    ``stream`` (stderr): one every ``every`` seconds and one at :meth:`close`, never a ``\\r``."""

    def __init__(self, total: int, desc: str, disable: bool = False, every: float = None,
                 stream=None, clock=time.perf_counter):
        self.total, self.desc, self.disable = total, desc, disable
        self.every = PROGRESS_EVERY if every is None else every
        self.stream, self.clock = stream, clock
        self.n = 0
        self.postfix = {}
        self._t0 = self._last = clock()

    def update(self, n: int = 1):
        self.n += n
        if not self.disable and self.clock() - self._last >= self.every:
            self._print()

    def set_postfix(self, refresh=False, **kwargs):
        self.postfix = kwargs

    def line(self) -> str:
        elapsed = self.clock() - self._t0
        rate = self.n / elapsed if elapsed > 0 else 0.0
        done = f"{self.n}/{self.total} steps ({100 * self.n // max(self.total, 1)}%)" if self.total \
            else f"{self.n} steps"
        eta = f", ETA {_clock((self.total - self.n) / rate)}" if self.total and rate > 0 else ""
        extra = "".join(f", {k} {v}" for k, v in self.postfix.items())
        return f"{self.desc}: {done}, {rate:.2f} steps/s, {_clock(elapsed)} elapsed{eta}{extra}"

    def _print(self):
        self._last = self.clock()
        print(self.line(), file=self.stream or sys.stderr, flush=True)

    def close(self):
        if not self.disable and self.n:
            self._print()
        self.disable = True


class _BarContext:
    def __init__(self, log, bar):
        self.log, self.bar = log, bar

    def __enter__(self):
        return self.bar

    def __exit__(self, *exc):
        self.bar.close()
        self.log._bar = None
        return False


def _jsonable(value):
    try:
        return value.item()
    except AttributeError:
        return str(value)
