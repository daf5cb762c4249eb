"""Framework-free helpers shared by the PyTorch and TensorFlow examples.

- :mod:`examples.common.cli`: the command-line flags every example takes (``--compression``,
  ``--reduction``, ``--epochs``, ``--max-steps``, ...), task defaults, and a parser for codec spec
  strings that needs no framework.
- :mod:`examples.common.data`: readers for the standard dataset files (MNIST IDX, CIFAR-10 python
  batches, SST-5 text) and the offline defaults that ship (scikit-learn's digits, synthetic images,
  synthetic sentiment text), all as NumPy arrays; rank sharding like ``DistributedSampler``.
- :mod:`examples.common.runlog`: the log lines of the runs we mirror (``Step200: 100.71 data/sec``,
  ``Epoch 0 in 543.88 sec, test time 13.77 sec, test accuracy:0.86263``), their regexes, the
  JSON-lines / CSV metrics file and the rank-0 tqdm progress bar.
- :mod:`examples.common.traffic`: bytes each rank sends per step for a codec and a reduction, beside
  fp32 ring allreduce. The formula lives here and nowhere else.

Nothing here imports torch, TensorFlow or Horovod.
"""
