"""PyTorch frontend: ``hvd_quant.torch.DistributedOptimizer`` and the torch side of the exchange.

Attributes are imported on first use: ``DistributedOptimizer`` imports ``horovod.torch``, while the
codecs reach ``hvd_quant.torch._backend`` (array adapters, ArrayOps) for torch tensors without
Horovod. Codecs passed to stock ``hvd.DistributedOptimizer(compression=...)`` reach the torch backend
through ``hvd_quant._stock``.
"""
from .._lazy import lazy_exports

_EXPORTS = {"OPS": "._backend", "collectives": "._backend", "DistributedOptimizer": ".optimizer",
            "resolve_codec": ".optimizer", "OneBitAdam": ".onebit_adam"}

__all__ = ["DistributedOptimizer", "OneBitAdam", "bytes_sent_per_step", "step_metrics", "collectives", "OPS",
           "resolve_codec"]


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)


def bytes_sent_per_step(optimizer):
    """``{"sent": bytes, "fp32": bytes, "ratio": fp32/sent, "gbps": GB/s}`` for the optimizer's last
    step: what this rank sent, beside what an fp32 ring allreduce of the same gradients would have
    sent, and the effective bandwidth of the exchange's collectives (``Traffic.bandwidth()``'s total;
    None where no exchange collective was timed). Works for
    ``hvd_quant.torch.DistributedOptimizer`` and for stock Horovod optimizers whose ``compression=`` is
    an hvd_quant codec or :class:`hvd_quant.StockCompression` (for those: since the last call)."""
    from .. import _stock
    t = optimizer.bytes_per_step() if hasattr(optimizer, "bytes_per_step") else None
    t = t if t is not None else _stock.take_traffic(getattr(optimizer, "_compression", None))
    return {"sent": t.sent_bytes, "fp32": t.fp32_bytes, "ratio": t.ratio,
            "gbps": t.bandwidth().get("total", {}).get("gbps")}


def step_metrics(optimizer):
    """What ``optimizer``'s last step did (:func:`hvd_quant.plan.step_metrics`: bytes sent and the
    fp32 equivalent, the exchange's time, the reduction and precision of each bucket), for
    ``hvd_quant.torch.DistributedOptimizer`` and for stock Horovod optimizers whose ``compression=``
    is an hvd_quant codec or :class:`hvd_quant.StockCompression` (for those: bytes since the last
    call, and no time). None for a stock optimizer before its first gradient or without our codec."""
    from .. import _stock
    if hasattr(optimizer, "step_metrics"):
        return optimizer.step_metrics()
    comp = getattr(optimizer, "_compression", None)
    if isinstance(comp, _stock.StockCompression):
        return comp.step_metrics(optimizer)
    return _stock.stock_compression(comp).step_metrics(optimizer) if hasattr(comp, "spec") else None
