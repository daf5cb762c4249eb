"""PyTorch frontend: ``hvd_quant.torch.DistributedOptimizer`` and the torch side of the exchange.

Attributes are imported on first use: ``DistributedOptimizer`` imports ``horovod.torch``, while the
codecs reach ``hvd_quant.torch._backend`` (array adapters, ArrayOps) for torch tensors without
Horovod. Codecs passed to stock ``hvd.DistributedOptimizer(compression=...)`` reach the torch backend
through ``hvd_quant._stock``.
"""
from .._lazy import lazy_exports

_EXPORTS = {"OPS": "._backend", "collectives": "._backend", "DistributedOptimizer": ".optimizer",
            "resolve_codec": ".optimizer"}

__all__ = ["DistributedOptimizer", "bytes_sent_per_step", "collectives", "OPS", "resolve_codec"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def bytes_sent_per_step(optimizer):
    """``{"sent": bytes, "fp32": bytes, "ratio": fp32/sent}`` for the optimizer's last step: what this
    rank sent, beside what an fp32 ring allreduce of the same gradients would have sent. Works for
    ``hvd_quant.torch.DistributedOptimizer`` and for stock Horovod optimizers whose ``compression=`` is
    an hvd_quant codec or :class:`hvd_quant.StockCompression` (for those: since the last call)."""
    from .. import _stock
    t = optimizer.bytes_per_step() if hasattr(optimizer, "bytes_per_step") else None
    t = t if t is not None else _stock.take_traffic(getattr(optimizer, "_compression", None))
    return {"sent": t.sent_bytes, "fp32": t.fp32_bytes, "ratio": t.ratio}
