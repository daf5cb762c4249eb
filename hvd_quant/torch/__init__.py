"""PyTorch frontend: ``hvd_quant.torch.DistributedOptimizer``, ``ddp_comm_hook``, ``fsdp_reduce_scatter``
and the torch side of the exchange. Attributes are imported on first use: ``DistributedOptimizer``
and ``OneBitAdam`` need ``horovod.torch``; ``ddp_comm_hook``, ``fsdp_reduce_scatter`` and the codecs
(``_backend.FRONTEND``) do not.
"""
from .._lazy import lazy_exports
from .. import _stock
from ..frontend import bytes_sent_per_step

_EXPORTS = {"OPS": "._backend", "collectives": "._backend", "resolve_codec": "._backend",
            "DistributedOptimizer": ".optimizer", "OneBitAdam": ".onebit_adam",
            "ddp_comm_hook": ".ddp", "DDPCommState": ".ddp",
            "fsdp_reduce_scatter": ".fsdp", "FSDPCommState": ".fsdp"}

__all__ = ["DistributedOptimizer", "OneBitAdam", "ddp_comm_hook", "DDPCommState", "fsdp_reduce_scatter",
           "FSDPCommState", "bytes_sent_per_step",
           "step_metrics", "collectives", "OPS", "resolve_codec"]


_lazy_getattr, __dir__ = lazy_exports(__name__, _EXPORTS)


def __getattr__(name):
    try:
        return _lazy_getattr(name)
    except ModuleNotFoundError as e:
        if (e.name or "").partition(".")[0] != "horovod":
            raise
        raise ImportError(f"hvd_quant.torch.{name} runs on Horovod (horovod.torch), which is not installed; "
                          f"hvd_quant.torch.ddp_comm_hook and fsdp_reduce_scatter need only torch.distributed") from e


def step_metrics(optimizer):
    """What ``optimizer``'s last step did (docs/EXCHANGE.md, "Traffic"), for ours and for stock Horovod
    optimizers with an hvd_quant ``compression=``; None for a stock one before its first gradient."""
    if hasattr(optimizer, "step_metrics"):
        return optimizer.step_metrics()
    sc = _stock.state_of(optimizer)
    return None if sc is None else sc.step_metrics(optimizer)
