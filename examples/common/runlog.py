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
"""
import csv
import json
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

CSV_FIELDS = ("event", "model", "step", "epoch", "elapsed", "train_time", "data_per_sec",
              "window_data_per_sec", "step_time", "loss", "lr", "epoch_time", "test_time",
              "test_accuracy", "test_loss", "steps", "samples", "bench_data_per_sec",
              "bytes_sent_per_step", "bytes_fp32_per_step")


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
                 progress: bool = True, stream=None):
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

    # -- phases
    def start_model(self, name: str):
        self.model = name
        self._window = (0, 0.0)
        self.emit(f"== model {name}")

    def bar(self, total: int, desc: str):
        """A tqdm bar on rank 0 (a no-op object elsewhere or when disabled); use as a context."""
        from tqdm import tqdm
        bar = tqdm(total=total, desc=desc, disable=not self.progress, file=sys.stderr, leave=False,
                   dynamic_ncols=True, mininterval=0.5 if sys.stderr.isatty() else 10.0)
        self._bar = None if bar.disable else bar
        return _BarContext(self, bar)

    def step(self, step: int, epoch: int, samples: int, train_time: float, loss: Optional[float] = None,
             lr: Optional[float] = None, step_time: Optional[float] = None, record: bool = False):
        """``samples``: all ranks' samples so far; ``train_time``: seconds of training so far.
        Prints the ``StepN`` line every ``log_every`` steps; writes a ``step`` record then, or when
        ``record`` is true."""
        rate = samples / train_time if train_time > 0 else 0.0
        fields = {"step": step, "epoch": epoch, "samples": samples, "train_time": round(train_time, 6),
                  "data_per_sec": rate, "loss": loss, "lr": lr, "step_time": step_time}
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

    def close(self):
        if self._file is not None:
            self._file.close()
            self._file = None


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
