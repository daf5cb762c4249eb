"""Benchmarks, run as ``python -m hvd_quant.bench <command> [options]``.

Commands are looked up in :data:`COMMANDS` (name -> module path), then as a module
``hvd_quant.bench.<name>``; the module's ``main(argv)`` gets the remaining arguments. A new benchmark is
a module here with a ``main(argv)`` (found by name), or an entry added with :func:`register`.
"""
import importlib
import pkgutil

__all__ = ["COMMANDS", "register", "commands", "run"]

COMMANDS = {
    "codec": "hvd_quant.bench.codec",
}


def register(name, module_path):
    """Make ``python -m hvd_quant.bench <name>`` run ``module_path``'s ``main(argv)``."""
    COMMANDS[name] = module_path


def commands():
    """Every runnable command: the registered ones and the modules of this package."""
    names = dict(COMMANDS)
    for m in pkgutil.iter_modules(__path__):
        if not m.name.startswith("_"):
            names.setdefault(m.name, f"{__name__}.{m.name}")
    return names


def run(argv):
    """Dispatch ``argv`` = [command, *options]; returns the command's exit status."""
    table = commands()
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m hvd_quant.bench <command> [options]\n\ncommands:")
        for name, path in sorted(table.items()):
            print(f"  {name:<10} ({path})")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    path = table.get(name)
    if path is None:
        print(f"unknown benchmark {name!r}; commands: {', '.join(sorted(table))}")
        return 2
    module = importlib.import_module(path)
    return module.main(rest) or 0
