"""TensorFlow frontend (docs/TENSORFLOW.md): Horovod's wrappers with the compressed exchange of a
:class:`GradientReducer`; :data:`OPS` / :func:`collectives`, the core's tables. Imported on first use.
"""
from .._lazy import lazy_exports

_EXPORTS = {
    "OPS": "._backend", "collectives": "._backend", "resolve_codec": "._backend",
    "GradientReducer": ".reducer",
    "DistributedGradientTape": ".wrappers", "DistributedOptimizer": ".wrappers",
    "bytes_sent_per_step": ".wrappers", "install_reducer": ".wrappers", "reducer_of": ".wrappers",
    "step_metrics": ".wrappers", "OneBitAdam": ".onebit_adam",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
