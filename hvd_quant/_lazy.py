"""Module attributes imported on first use (the frontends' packages: their framework comes with them)."""
import importlib
import sys


def lazy_exports(module_name, exports):
    """``(__getattr__, __dir__)`` for module ``module_name`` whose attribute ``name`` lives in the
    submodule ``exports[name]`` (relative, e.g. ``"._backend"``), imported when first asked for."""
    def __getattr__(name):
        mod = exports.get(name)
        if mod is None:
            raise AttributeError(f"module {module_name!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(mod, module_name), name)
        setattr(sys.modules[module_name], name, value)
        return value

    def __dir__():
        return sorted(set(vars(sys.modules[module_name])) | set(exports))

    return __getattr__, __dir__
