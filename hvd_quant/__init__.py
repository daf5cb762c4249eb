"""hvd_quant: QSGD and 1-bit SGD gradient compression for Horovod."""
__version__ = "0.1.0"
