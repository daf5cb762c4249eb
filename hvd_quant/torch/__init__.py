"""PyTorch frontend: ``hvd_quant.torch.DistributedOptimizer`` and the torch side of the exchange.

Attributes are imported on first use: ``DistributedOptimizer`` imports ``horovod.torch``, while the
codecs reach the torch frontend (``hvd_quant.torch._backend.FRONTEND``: array adapters, ArrayOps)
for torch tensors without Horovod. Codecs passed to stock ``hvd.DistributedOptimizer(compression=...)``
reach it through ``hvd_quant._stock``.
"""
from .._lazy import lazy_exports
from .. import _stock
from ..frontend import bytes_sent_per_step

_EXPORTS = {"OPS": "._backend", "collectives": "._backend", "resolve_codec": "._backend",
            "DistributedOptimizer": ".optimizer", "OneBitAdam": ".onebit_adam"}

__all__ = ["DistributedOptimizer", "OneBitAdam", "bytes_sent_per_step", "step_metrics", "collectives",
           "OPS", "resolve_codec"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def step_metrics(optimizer):
    """What ``optimizer``'s last step did (:func:`hvd_quant.scheduler.step_metrics`: bytes sent and the
    fp32 equivalent, the exchange's time, the reduction and precision of each bucket), for
    ``hvd_quant.torch.DistributedOptimizer`` and for stock Horovod optimizers whose ``compression=``
    is an hvd_quant codec or :class:`hvd_quant.StockCompression` (for those: bytes since the last
    call, and no time). None for a stock optimizer before its first gradient or without our codec."""
    if hasattr(optimizer, "step_metrics"):
        return optimizer.step_metrics()
    sc = _stock.state_of(optimizer)
    return None if sc is None else sc.step_metrics(optimizer)
