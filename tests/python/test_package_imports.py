"""The fusedamp package's modules import one way: no module reaches itself again through its
imports, whether written at the top of a file or inside a function (a function-level import
only hides a circle until someone moves it). The graph is read from the sources with ``ast``.
Every module is also imported in a fresh interpreter: each must load (a framework adapter
may miss only its framework)."""
import ast
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES


PYTHON_DIR = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
PACKAGE = "fusedamp"


def package_modules(root=PYTHON_DIR, package=PACKAGE):
    """{module name: source path} of every module under the package: its .py files, and its
    compiled extensions (path None: they import nothing of the package)."""
    modules = {}
    for folder, _, files in os.walk(os.path.join(root, package)):
        for name in files:
            path = os.path.join(folder, name)
            suffix = next((s for s in (".py",) + tuple(EXTENSION_SUFFIXES)
                           if name.endswith(s)), None)
            if suffix is None:
                continue
            parts = os.path.relpath(path, root)[:-len(suffix)].split(os.sep)
            if suffix != ".py":
                modules[".".join(parts)] = None
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _resolve(importer, is_package, level, module):
    """The absolute name of `from <level dots><module> import ...` written in `importer`."""
    if level == 0:
        return module
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name, path, modules):
    """The package modules that module `name` imports, anywhere in its source."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    is_package = os.path.basename(path) == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(name, is_package, node.level, node.module)
            # `from pkg import sub` imports the submodule; `from mod import attr`, the module.
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules
                       else source for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules and t != name)
    return found


def find_circle(graph):
    """A list of modules [a, b, ..., a] where each imports the next, or None."""
    state = {}  # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                circle = visit(nxt, path)
                if circle:
                    return circle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            circle = visit(start, [])
            if circle:
                return circle
    return None


def import_graph(root=PYTHON_DIR, package=PACKAGE):
    modules = package_modules(root, package)
    return {name: imports_of(name, path, modules) if path else set()
            for name, path in modules.items()}


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert {"fusedamp.optim", "fusedamp.fsdp", "fusedamp.compiled_step"} <= graph.keys()
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_graph_sees_function_level_imports_and_circles(tmp_path):
    """The check itself: a circle closed only by an import inside a function is found, and
    `from . import x` names the submodule x."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from . import a\n")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    graph = import_graph(str(tmp_path), "pkg")
    assert graph == {"pkg": {"pkg.a"}, "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.a"}}
    assert find_circle(graph) == ["pkg.a", "pkg.b", "pkg.a"]
    (pkg / "b.py").write_text("def f():\n    return 1\n")
    assert find_circle(import_graph(str(tmp_path), "pkg")) is None


# Modules that exist to adapt a framework the package does not depend on: importing them
# without it installed is expected to fail with ModuleNotFoundError naming that framework.
OPTIONAL = {"fusedamp.lightning": ("pytorch_lightning", "lightning"),
            "fusedamp.hf": ("transformers",)}


def test_every_module_imports_in_a_fresh_interpreter():
    names = sorted(name for name, path in package_modules().items() if path)
    script = (
        "import importlib, json, sys\n"
        "out = {}\n"
        "for name in json.loads(sys.argv[1]):\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        out[name] = ['missing', e.name or '']\n"
        "    except Exception as e:\n"
        "        out[name] = ['error', f'{type(e).__name__}: {e}']\n"
        "print(json.dumps(out))\n")
    env = dict(os.environ, PYTHONPATH=PYTHON_DIR + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script, json.dumps(names)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    failures = {name: what for name, (kind, what) in failed.items()
                if not (kind == "missing" and what.split(".")[0] in OPTIONAL.get(name, ()))}
    assert not failures, failures
