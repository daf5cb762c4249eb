"""Which frontend serves an object: one registry, read by the codecs (``hvd_quant._arrays``: the
array adapter of what they were given) and by the stock path (``hvd_quant._stock``: the frontend of
the tensor Horovod hands to ``compress``).

An entry maps the top-level module of ``type(obj)`` (``"torch"``) to the frontend: an object with
the interface of :class:`hvd_quant.frontend.Frontend` (the codecs need only its ``adapter(obj)``),
or its import path, ``"package.module"`` (the module is the frontend) or
``"package.module:attribute"``, imported the first time an object of that framework comes by, so
that no framework is imported before it is used. Resolved once per type.
"""
import importlib

__all__ = ["FRONTENDS", "register_frontend", "frontend_for"]

FRONTENDS = {
    "numpy": "hvd_quant._arrays",
    "torch": "hvd_quant.torch._backend:FRONTEND",
    "tensorflow": "hvd_quant.tensorflow._backend:FRONTEND",
}

# ml_dtypes' scalar and array types (bfloat16 NumPy values, what TensorFlow's .numpy() gives) are NumPy's
_SAME_AS = {"ml_dtypes": "numpy"}

_BY_TYPE = {}           # type(obj) -> its frontend, resolved once


def register_frontend(top_module, frontend):
    """Route objects whose type lives under ``top_module`` to ``frontend`` (an object, or its import
    path as in the module doc)."""
    FRONTENDS[top_module] = frontend
    _BY_TYPE.clear()


def _load(entry):
    if not isinstance(entry, str):
        return entry
    module, _, attribute = entry.partition(":")
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


def frontend_for(obj):
    """The frontend of ``obj``'s framework, or None where none is registered."""
    frontend = _BY_TYPE.get(type(obj))
    if frontend is None:
        top = type(obj).__module__.split(".", 1)[0]
        entry = FRONTENDS.get(_SAME_AS.get(top, top))
        if entry is None:
            return None
        frontend = _BY_TYPE[type(obj)] = _load(entry)
    return frontend
