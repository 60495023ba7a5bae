"""One layer order, no cycles: every import of our own modules points down (DESIGN.md, "Layers").

Parsed with `ast`, so it sees imports inside functions too (where heavy libraries keep
`appliance --help` light). The rules are in LAYERS; a planted violation makes the test fail.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "data_tools")

# Lowest first. A module may import modules of its own layer's group and of lower layers only.
# Groups in one layer are side by side: none may import another.
LAYERS = [
    ("core", ["appliance", "appliance.core", "appliance.assets", "appliance.__main__"]),
    ("data", ["data_tools"]),
    ("models", ["appliance.models"]),
    ("tasks", ["appliance.tasks"]),  # per task: samples, model, loss, figures, gate (DESIGN.md "models and tasks")
    ("stages", ["appliance.train", "appliance.deploy", "appliance.bundle"]),
    ("pipeline", ["appliance.pipeline"]),
    ("cli", ["appliance.cli", "appliance.doctor", "*.cli"]),
]
EXCEPTIONS = {
    # appliance/__main__.py runs the CLI: it is the entry point, above everything.
    ("appliance.__main__", "appliance.cli"),
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def place(module: str) -> tuple[int, str]:
    """(layer index, group) of a module: the longest matching prefix wins; cli modules are on top."""
    best = None
    for index, (_, groups) in enumerate(LAYERS):
        for group in groups:
            if group == "*.cli":
                if module.endswith(".cli") or ".cli." in module:
                    return index, group
                continue
            # The package `appliance` itself is core; its sub-packages are placed by their own names.
            if module == group or (group != "appliance" and module.startswith(group + ".")):
                if best is None or len(group) > len(best[1]):
                    best = (index, "core" if LAYERS[index][0] == "core" else group)
    if best is None:
        raise AssertionError(f"{module}: not placed in any layer of tests/test_layers.py")
    return best


def our_imports(path: Path, module: str, root: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of appliance/data_tools in the file."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from appliance.deploy import stages` imports a module; `from x import name` imports x.
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base for a in node.names]
        else:
            continue
        found += [(n, node.lineno) for n in names if n.split(".")[0] in PACKAGES]
    return found


def _is_module(name: str, root: Path) -> bool:
    p = root.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def violations(root: Path = ROOT) -> list[str]:
    problems = []
    graph: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            if path.parts[-2] == "edge" and path.name == "run.py":
                continue  # the edge package's own runner, run on the device, not imported here
            module = module_name(path, root)
            here = place(module)
            for target, line in our_imports(path, module, root):
                graph.setdefault(module, set()).add(target)
                if (module, target) in EXCEPTIONS or target == module:
                    continue
                there = place(target)
                if there[0] > here[0]:
                    problems.append(f"{path.relative_to(root)}:{line}: {module} ({LAYERS[here[0]][0]}) imports "
                                    f"{target} ({LAYERS[there[0]][0]}), a higher layer")
                elif there[0] == here[0] and there[1] != here[1] and LAYERS[here[0]][0] != "cli":
                    problems.append(f"{path.relative_to(root)}:{line}: {module} imports {target}: "
                                    f"{here[1]} and {there[1]} are side by side and must not import each other")
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every elementary cycle found by depth-first search (one per back edge)."""
    found, state = [], {}

    def visit(node, stack):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt == node or (node, nxt) in EXCEPTIONS:
                continue
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return found


def test_every_import_points_down_and_there_is_no_cycle():
    problems = violations()
    assert not problems, "\n".join(problems)


def test_a_planted_violation_fails(tmp_path):
    # A copy of the tree with training importing from deploy, and a two-module cycle in data_tools.
    import shutil

    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "appliance" / "train" / "planted.py").write_text("from appliance.deploy import stages\n")
    (tmp_path / "data_tools" / "planted_a.py").write_text("import data_tools.planted_b\n")
    (tmp_path / "data_tools" / "planted_b.py").write_text("def f():\n    from data_tools import planted_a\n")
    problems = violations(tmp_path)
    assert any("appliance.train.planted" in p and "side by side" in p for p in problems), problems
    assert any(p.startswith("import cycle:") and "data_tools.planted_a" in p for p in problems), problems


@pytest.mark.parametrize("module, layer", [("appliance.core.errors", "core"), ("data_tools.tfrecord", "data"),
                                           ("data_tools.check.cli", "cli"), ("appliance.deploy.stages", "stages"),
                                           ("appliance.pipeline.runner", "pipeline")])
def test_layers_place_modules_as_documented(module, layer):
    assert LAYERS[place(module)[0]][0] == layer
