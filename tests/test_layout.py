"""The package's shape: imports point one way, nothing imports the benchmarks, the installed package holds none."""

import ast
import os
import subprocess
import sys

from conftest import ROOT

PACKAGE = os.path.join(ROOT, "gpupar")


def _modules():
    """{module name: path} of every module of the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, ROOT)[:-3].split(os.sep)
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path, module, modules):
    """The modules (of `modules`, or any name) that the module at `path` imports, at any depth of its code."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules)
    return {name for name in names if name}


def _cycle(graph):
    """A list of modules that import each other in a circle, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def _graph():
    modules = _modules()
    return {m: {i for i in _imports(p, m, modules) if i in modules and i != m} for m, p in modules.items()}, modules


def test_no_module_imports_another_in_a_circle():
    graph, _ = _graph()
    assert len(graph) > 30  # the walk found the package
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_walk_finds_a_circle_when_there_is_one():
    """Control: the same search on a made-up graph with a cycle."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_training_imports_point_one_way():
    graph, _ = _graph()
    order = ["gpupar.training.steps", "gpupar.training.engine", "gpupar.training.loop", "gpupar.training.run",
             "gpupar.cli"]
    assert order[0] in graph[order[1]] and order[2] in graph[order[3]] and order[3] in graph[order[4]]
    for i, lower in enumerate(order):
        assert not set(order[i + 1:]) & graph[lower], f"{lower} imports a module above it"


def test_nothing_in_the_package_imports_the_benchmarks():
    _, modules = _graph()
    offenders = [m for m, p in modules.items() if any(i.split(".")[0] == "benchmarks" for i in _imports(p, m, modules))]
    assert offenders == []


def test_the_built_package_holds_no_benchmarks(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    import zipfile

    (wheel,) = tmp_path.glob("gpupar-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gpupar/training/engine.py" in names and "gpupar/runtime/strategy.py" in names
    assert not [n for n in names if n.startswith("benchmarks/") or "/bench" in n]
