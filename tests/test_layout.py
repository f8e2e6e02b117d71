"""The package's shape: imports point one way between packages and inside each, nothing imports the benchmarks, the
installed package holds none."""

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
            submodules = {f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in modules}
            names.update(submodules)
            if len(submodules) < len(node.names):  # a name of the package itself, not only its modules
                names.add(base)
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


LAYOUT_DOC = os.path.join(ROOT, "docs", "how-it-works.md")


def documented_order(text):
    """{package: its modules and subpackages, lowest first} from the layout list of docs/how-it-works.md.

    The list's first code block starting `gpupar/`: a name per line, two spaces of indent per level, a folder's
    name ending in "/"; the deeper-indented lines under a module's line continue its description. A module may
    import from its own rank and those below it (listed above it), never from above; a package's own __init__
    ranks above all of its modules (it may gather them).
    """
    block = text[text.index("```\ngpupar/\n") + 4:]
    block = block[:block.index("```")]
    order, parents = {}, []  # parents: (indent, package) of the open folders
    previous_indent = None
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        name = line.split()[0] if line.strip() else ""
        if not name or (previous_indent is not None and indent > previous_indent + 2):
            continue  # a blank line, or a description's continuation
        if indent == 0 and name != "gpupar/":
            break  # benchmarks/, docs/: not the package
        while parents and parents[-1][0] >= indent:
            parents.pop()
        if parents:
            order.setdefault(parents[-1][1], []).append(name.rstrip("/"))
        if name.endswith("/"):
            package = f"{parents[-1][1]}.{name[:-1]}" if parents else name[:-1]
            parents.append((indent, package))
        previous_indent = indent
    return order


ORDER = documented_order(open(LAYOUT_DOC).read())


def test_the_documented_order_is_read_as_written():
    """Control of the reader: folders nest by indent, continuation lines are no modules, the list ends at gpupar/'s."""
    text = """intro
```
gpupar/
  low          the lowest
  sub/         a folder
    a          its first
    b          its second, described
               over two lines
  high         above sub
benchmarks/    not the package
```
"""
    assert documented_order(text) == {"gpupar": ["low", "sub", "high"], "gpupar.sub": ["a", "b"]}


def test_every_documented_module_exists():
    graph, _ = _graph()
    listed = {f"{package}.{name}" for package, names in ORDER.items() for name in names if name != "__init__"}
    assert sorted(listed - set(graph)) == []
    assert ORDER["gpupar"][-3:] == ["__init__", "cli", "__main__"] and "gpupar.training.steps" in ORDER


def _rank(module, package):
    """The rank inside `package` of the module or subpackage holding `module` (the package itself: its "__init__"
    entry, else above all)."""
    if module == package:
        order = ORDER[package]
        return order.index("__init__") if "__init__" in order else len(order)
    child = module[len(package) + 1:].split(".")[0]
    return ORDER[package].index(child) if child in ORDER[package] else None


def climbing_imports(graph):
    """["a imports b", ...] for every import from a rank above the importer's, in the deepest package holding both."""
    climbs = []
    for module, imported in sorted(graph.items()):
        for other in sorted(imported):
            shared = [p for p in ORDER if all(m == p or m.startswith(p + ".") for m in (module, other))]
            package = max(shared, key=len)
            mine, theirs = _rank(module, package), _rank(other, package)
            if mine is not None and theirs is not None and theirs > mine:
                climbs.append(f"{module} imports {other}")
    return climbs


def test_every_module_has_a_rank_in_its_package():
    graph, _ = _graph()
    unranked = []
    for module in graph:
        package = module.rpartition(".")[0] if module not in ORDER else module.rpartition(".")[0] or module
        if module != "gpupar" and package in ORDER and _rank(module, package) is None:
            unranked.append(module)
    assert unranked == []
    assert set(ORDER) <= set(graph)  # every ordered package exists


def test_no_module_imports_from_a_rank_above_its_own():
    graph, _ = _graph()
    assert "gpupar.training.run" in graph["gpupar.cli"] or "gpupar.training.run" in graph["gpupar"]
    assert climbing_imports(graph) == []


def test_the_rank_check_finds_an_import_that_climbs():
    """Control: the package's graph with climbs added between layers and inside packages, subpackages included."""
    graph, _ = _graph()
    added = {"gpupar.runtime.strategy": "gpupar.training.loop", "gpupar.training.result": "gpupar.training.setup",
             "gpupar.training.checkpoint": "gpupar.training.modes.parameter_server",
             "gpupar.runtime.devices": "gpupar.runtime.launch",
             "gpupar.training.steps.compiled": "gpupar.training.steps.own",
             "gpupar.training.modes.mode": "gpupar.training.modes"}
    for module, other in added.items():
        graph[module] = graph[module] | {other}
    assert climbing_imports(graph) == sorted(f"{m} imports {o}" for m, o in added.items())


def test_no_two_modules_of_the_package_share_a_name():
    _, modules = _graph()
    names = [m.rsplit(".", 1)[-1] for m in modules if not modules[m].endswith("__init__.py")]
    assert sorted(n for n in set(names) if names.count(n) > 1) == []


def test_nothing_in_the_package_imports_the_benchmarks():
    _, modules = _graph()
    offenders = [m for m, p in modules.items() if any(i.split(".")[0] == "benchmarks" for i in _imports(p, m, modules))]
    assert offenders == []


PRIVATE = ("keras.src", "tensorflow.python", "tensorflow.core", "tensorflow.tsl")  # Keras' and TensorFlow's own code


def private_imports(modules) -> list:
    """["module imports name", ...] for every import of Keras' or TensorFlow's private code outside keras_compat."""
    return sorted(f"{m} imports {i}" for m, p in modules.items() if m != "gpupar.keras_compat"
                  for i in _imports(p, m, modules) if any(i == x or i.startswith(x + ".") for x in PRIVATE))


def test_only_keras_compat_imports_keras_or_tensorflow_private_code():
    _, modules = _graph()
    assert private_imports(modules) == []


def test_the_private_import_check_finds_one(tmp_path):
    """Control: a module importing keras.src is named; the same import in keras_compat is not."""
    module = tmp_path / "offender.py"
    module.write_text("from keras.src.trainers import trainer\nimport tensorflow.python.distribute\n")
    assert private_imports({"gpupar.offender": str(module)}) == [
        "gpupar.offender imports keras.src.trainers", "gpupar.offender imports tensorflow.python.distribute"]
    assert private_imports({"gpupar.keras_compat": str(module)}) == []


def test_the_built_package_holds_no_benchmarks(tmp_path):
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), ROOT], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    import zipfile

    (wheel,) = tmp_path.glob("gpupar-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "gpupar/training/trainer.py" in names and "gpupar/runtime/strategy.py" in names
    assert not [n for n in names if n.startswith("benchmarks/") or "/bench" in n]
