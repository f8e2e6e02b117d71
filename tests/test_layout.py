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


# The layers, lowest first: a module may import from its own layer and those below it, never from above.
LAYERS = ["gpupar.errors", "gpupar.config", "gpupar.runtime", "gpupar.data", "gpupar.models", "gpupar.monitor",
          "gpupar.training", "gpupar.presets", "gpupar.commands", "gpupar", "gpupar.cli", "gpupar.__main__"]
# Inside training, the steps' chain: step <- engine <- modes <- setup <- loop <- run.
TRAINING = ["gpupar.training.objective", "gpupar.training.inner_loop", "gpupar.training.step", "gpupar.training.own_step",
            "gpupar.training.engine",
            "gpupar.training.modes", "gpupar.training.setup", "gpupar.training.observers", "gpupar.training.loop",
            "gpupar.training.run"]


def _rank(module, order):
    """The index in `order` of the longest entry that is module or a package holding it, or None."""
    found = [i for i, name in enumerate(order) if module == name or module.startswith(name + ".")]
    return max(found, key=lambda i: len(order[i])) if found else None


def climbing_imports(graph):
    """["a imports b", ...] for every import from a layer above the importer's (LAYERS, then TRAINING inside training)."""
    climbs = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            for order in (LAYERS, TRAINING):
                mine, theirs = _rank(module, order), _rank(other, order)
                if mine is not None and theirs is not None and theirs > mine:
                    climbs.append(f"{module} imports {other}")
    return climbs


def test_every_module_has_a_layer():
    graph, _ = _graph()
    assert [m for m in graph if _rank(m, LAYERS) is None] == []
    assert {m for m in graph if m.startswith("gpupar.training.") and _rank(m, TRAINING) is None} == {
        "gpupar.training.checkpoint", "gpupar.training.interrupt", "gpupar.training.multi_worker",
        "gpupar.training.outputs", "gpupar.training.result", "gpupar.training.task"}  # helpers of the loop and the run


def test_no_module_imports_from_a_layer_above_its_own():
    graph, _ = _graph()
    assert "gpupar.training.run" in graph["gpupar.cli"] or "gpupar.training.run" in graph["gpupar"]
    assert climbing_imports(graph) == []


def test_the_layer_check_finds_an_import_that_climbs():
    """Control: the graph of the package with one import added from the runtime up to the loop, and one inside training."""
    graph, _ = _graph()
    graph["gpupar.runtime.strategy"] = graph["gpupar.runtime.strategy"] | {"gpupar.training.loop"}
    graph["gpupar.training.step"] = graph["gpupar.training.step"] | {"gpupar.training.setup"}
    assert climbing_imports(graph) == ["gpupar.runtime.strategy imports gpupar.training.loop",
                                       "gpupar.training.step imports gpupar.training.setup"]


def test_no_two_modules_of_the_package_share_a_name():
    _, modules = _graph()
    names = [m.rsplit(".", 1)[-1] for m in modules if not modules[m].endswith("__init__.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


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
