"""The package's import graph: one direction, no cycles, and a light `import oscar_hf`."""

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).parents[1] / "oscar_hf"
CALIBRATION = ("autocalibrate", "calibrate", "capture", "diagnostics", "layout_choice")


def import_graph() -> dict[str, set[str]]:
    """Module → the oscar_hf modules it imports (every import statement, lazy and TYPE_CHECKING ones included)."""
    modules = {".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in ROOT.rglob("*.py")}
    graph = {m: set() for m in modules}
    for module, path in modules.items():
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for name in names:
                while name and name not in modules:
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while (w := stack.pop()) != v:
                on.discard(w)
                component.append(w)
            on.discard(v)
            if component:
                found.append(sorted([v, *component]))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_module_imports_another_modules_private_names():
    graph = import_graph()
    private = []
    for path in ROOT.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("oscar_hf")):
                private += [f"{path.relative_to(ROOT.parent)}: {alias.name}" for alias in node.names
                            if alias.name.startswith("_") and alias.name != "__version__"]
    assert graph and private == []


def test_importing_oscar_hf_loads_no_calibration_and_no_triton_kernels():
    """Without triton installed (blocked here) too: the CPU install without the triton extra."""
    code = ("import sys; sys.modules['triton'] = None\n"
            "import oscar_hf\nfrom oscar_hf.config import OscarConfig\n"
            "print(sorted(m for m in sys.modules if m.startswith('oscar_hf')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = eval(out)
    assert not [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in CALIBRATION]
    assert not [m for m in loaded if m.endswith(".triton")]
