"""The import graph of ``hvd_quant`` and ``numba_kernels`` has no cycle.

Every module's imports are read with ``ast`` (function-local ones included, relative ones resolved)
and turned into a module graph; a cycle is reported with its modules in order. An import of a
package counts as an import of its ``__init__``; ``from pkg import name`` counts as an import of
``pkg.name`` when that is a module, else of ``pkg``. A module reached by a literal name at run time,
``sys.modules["pkg.mod"]`` or ``importlib.import_module("pkg.mod")``, is an import too: the
dependency is the same, only hidden.
"""
import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("hvd_quant", "numba_kernels")

def module_files(root=ROOT, packages=PACKAGES):
    """{module name: path} of every .py module of ``packages`` under ``root``."""
    out = {}
    for pkg in packages:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def imports_of(name, path, modules):
    """The modules of ``modules`` that module ``name`` (file ``path``) imports, anywhere in its body."""
    is_pkg = path.name == "__init__.py"
    here = name if is_pkg else name.rpartition(".")[0]
    found = set()

    def resolve(target):
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                resolve(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = here
                for _ in range(node.level - 1):
                    anchor = anchor.rpartition(".")[0]
                base = f"{anchor}.{base}" if base else anchor
            for alias in node.names:
                full = f"{base}.{alias.name}"
                resolve(full if full in modules else base)
        elif isinstance(node, ast.Subscript) and _dotted(node.value) == "sys.modules":
            if isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
                resolve(node.slice.value)
        elif isinstance(node, ast.Call) and _dotted(node.func) in ("importlib.import_module",
                                                                    "import_module"):
            if node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                resolve(node.args[0].value)
    return found


def _dotted(node):
    """``a.b.c`` of an attribute chain of names, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


def import_graph(root=ROOT, packages=PACKAGES):
    modules = module_files(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph):
    """The strongly connected components of more than one module (or a self loop), each as a cycle
    through its modules, found with Tarjan's algorithm."""
    index, low, stack, on, comps = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(_path(graph, sorted(comp)))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return comps


def _path(graph, comp):
    """One cycle through the first module of ``comp`` (breadth-first, inside the component)."""
    start, inside = comp[0], set(comp)
    prev, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v]):
                if w not in inside:
                    continue
                if w == start:
                    path = [v]
                    while prev[path[-1]] is not None:
                        path.append(prev[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    return comp


def test_graph_is_read():
    g = import_graph()
    assert "hvd_quant.exchange" in g and "numba_kernels.wire" in g
    assert "numba_kernels.wire" in g["numba_kernels"]            # from .wire import ... in a package
    assert "hvd_quant._arrays" in g["hvd_quant.exchange"]         # a relative import


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" -> ".join(c) for c in found)


def test_cycle_is_found(tmp_path):
    """A cycle injected into a copy-shaped package is named, through a function-local import."""
    pkg = tmp_path / "numba_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from numba_kernels import c\n")
    (pkg / "c.py").write_text("import numba_kernels.a\n")
    found = cycles(import_graph(tmp_path, ("numba_kernels",)))
    assert found == [["numba_kernels.a", "numba_kernels.b", "numba_kernels.c", "numba_kernels.a"]], found


def test_hidden_import_is_found(tmp_path):
    """A module reached through ``sys.modules`` or ``importlib`` by a literal name closes a cycle."""
    pkg = tmp_path / "numba_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import sys\ndef f():\n    return sys.modules['numba_kernels.b'].g\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("import importlib\nA = importlib.import_module('numba_kernels.a')\n")
    found = cycles(import_graph(tmp_path, ("numba_kernels",)))
    assert found == [["numba_kernels.a", "numba_kernels.b", "numba_kernels.c", "numba_kernels.a"]], found
