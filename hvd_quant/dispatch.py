"""Which frontend serves an object: the top-level module of ``type(obj)`` (``"torch"``) -> a Frontend or its
import path ``"package.module[:attribute]"``, imported at that framework's first object; once per type."""
import importlib

__all__ = ["FRONTENDS", "STOCK_HOOKS", "register_frontend", "frontend_for", "stock_hook_for"]

FRONTENDS = {
    "numpy": "hvd_quant._arrays",
    "torch": "hvd_quant.torch._backend:FRONTEND",
    "tensorflow": "hvd_quant.tensorflow._backend:FRONTEND",
}

# ml_dtypes' scalar and array types (bfloat16 NumPy values, what TensorFlow's .numpy() gives) are NumPy's
_SAME_AS = {"ml_dtypes": "numpy"}

# A framework's own stock compress, ``hook(stock_compression, tensor)`` -> ``(tensor, ctx)`` or None (the
# generic path): TensorFlow's graphs, a module that builds on the frontend, so registered beside it.
STOCK_HOOKS = {
    "tensorflow": "hvd_quant.tensorflow._graph:stock_compress",
}

_BY_TYPE = {}           # type(obj) -> its frontend, resolved once
_HOOK_BY_TYPE = {}      # type(obj) -> its stock hook or None, resolved once


def register_frontend(top_module, frontend):
    """Route objects whose type lives under ``top_module`` to ``frontend`` (an object or its import path)."""
    FRONTENDS[top_module] = frontend
    _BY_TYPE.clear()
    _HOOK_BY_TYPE.clear()


def _resolve(table, cache, obj):
    """``table``'s entry for ``obj``'s framework, loaded; None where it has none. Once per type."""
    try:
        return cache[type(obj)]
    except KeyError:
        top = type(obj).__module__.split(".", 1)[0]
        entry = table.get(_SAME_AS.get(top, top))
        if isinstance(entry, str):
            module, _, attribute = entry.partition(":")
            entry = importlib.import_module(module)
            entry = getattr(entry, attribute) if attribute else entry
        cache[type(obj)] = entry
        return entry


def frontend_for(obj):
    """The frontend of ``obj``'s framework, or None where none is registered."""
    frontend = _BY_TYPE.get(type(obj))      # (the codecs ask at every call)
    return frontend if frontend is not None else _resolve(FRONTENDS, _BY_TYPE, obj)


def stock_hook_for(obj):
    """The stock path's hook of ``obj``'s framework (:data:`STOCK_HOOKS`), or None."""
    return _resolve(STOCK_HOOKS, _HOOK_BY_TYPE, obj)
