"""What docs/dev/architecture.md says about the house, checked: one layer order and no cycles (every import of our
own modules points down), the compiler's inner order (kernels <- passes <- pipeline; tuning uses
neither), stage modules that never import one another, a pipeline that never names another stage's
files, and every import made through importlib or a string in one allow-list with its reason.

Parsed with `ast`, so it sees imports inside functions too (where heavy libraries keep
`appliance --help` light). appliance/, data_tools/, benchmarks/ and installer/ are scanned; a planted
violation of each rule makes its test fail.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "data_tools")  # our modules: what an import is checked against
SCANNED = (*PACKAGES, "benchmarks", "installer")  # where imports are looked for

# Lowest first. A module may import modules of its own layer's group and of lower layers only.
# Groups in one layer are side by side: none may import another.
LAYERS = [
    ("core", ["appliance", "appliance.core", "appliance.assets", "appliance.__main__"]),
    ("data", ["data_tools"]),
    ("models", ["appliance.models"]),
    ("tasks", ["appliance.tasks"]),  # per task: samples, model, loss, figures, gate (docs/dev/architecture.md, the picture)
    ("stages", ["appliance.train", "appliance.deploy", "appliance.bundle"]),
    ("search", ["appliance.tune"]),  # `appliance tune`: trials are training runs (appliance.train's stage)
    ("pipeline", ["appliance.pipeline"]),
    ("cli", ["appliance.cli", "appliance.doctor", "*.cli"]),
    ("tools", ["benchmarks", "installer"]),  # scripts over the whole product; nothing of ours imports them
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


_SCANS: dict[str, tuple[list, list]] = {}
_TREES: dict[str, ast.Module] = {}


def parsed(path: Path) -> ast.Module:
    """The syntax tree of a file, parsed once per distinct text (a planted tree copy shares most)."""
    text = path.read_text()
    if text not in _TREES:
        _TREES[text] = ast.parse(text, str(path))
    return _TREES[text]


def scan(path: Path) -> tuple[list, list]:
    """(import nodes, (string, line) constants) of a file, parsed once per distinct text."""
    text = path.read_text()
    if text not in _SCANS:
        imports, strings = [], []
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                imports.append(node)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                strings.append((node.value, node.lineno))
        _SCANS[text] = imports, strings
    return _SCANS[text]


def our_imports(path: Path, module: str, root: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import of appliance or data_tools in the file."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in scan(path)[0]:
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            # `from appliance.deploy import export` imports a module; `from x import name` imports x.
            names = [f"{base}.{a.name}" if _is_module(f"{base}.{a.name}", root) else base for a in node.names]
        else:
            continue
        found += [(n, node.lineno) for n in names if n.split(".")[0] in PACKAGES]
    return found


def _is_module(name: str, root: Path) -> bool:
    p = root.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def sources(root: Path):
    """(path, module name) of every Python file scanned."""
    for package in SCANNED:
        for path in sorted((root / package).rglob("*.py")):
            if path.parts[-2] == "edge" and path.name == "run.py":
                continue  # the edge package's own runner, run on the device, not imported here
            yield path, module_name(path, root)


def violations(root: Path = ROOT) -> list[str]:
    problems = []
    graph: dict[str, set[str]] = {}
    for path, module in sources(root):
        here = place(module)
        for target, line in our_imports(path, module, root) + string_imports(path, module, root):
            graph.setdefault(module, set()).add(target)
            if (module, target) in EXCEPTIONS or target == module:
                continue
            there = place(target)
            where = f"{path.relative_to(root)}:{line}: {module}"
            if there[0] > here[0]:
                problems.append(f"{where} ({LAYERS[here[0]][0]}) imports {target} ({LAYERS[there[0]][0]}), a higher layer")
            elif there[0] == here[0] and there[1] != here[1] and LAYERS[here[0]][0] != "cli":
                problems.append(f"{where} imports {target}: {here[1]} and {there[1]} are side by side and must not "
                                "import each other")
            problems += inner_order(where, module, target)
    problems += [f"import cycle: {' -> '.join(c)}" for c in cycles(graph)]
    return problems


# Inside the compiler (docs/dev/architecture.md, rule 2): passes use kernels, the pipeline uses passes,
# tuning uses neither. A module under the first prefix may not import one under any of the others.
COMPILER = "appliance.deploy.compiler"
COMPILER_ORDER = [
    (f"{COMPILER}.kernels", [f"{COMPILER}.passes", f"{COMPILER}.pipeline", f"{COMPILER}.driver"]),
    (f"{COMPILER}.passes", [f"{COMPILER}.pipeline", f"{COMPILER}.driver"]),
    (f"{COMPILER}.tuning", [f"{COMPILER}.kernels", f"{COMPILER}.passes"]),
]

# The stage modules: each stage's own modules, in its package. One stage never imports another's;
# what two stages share lives in a shared module (deploy/samples.py, deploy/onnx_model.py,
# deploy/tolerance.py, data_tools.check.gate). Each deploy stage's typed result lives in its module.
STAGE_MODULES = {
    "check": ["data_tools.check.stage", "data_tools.check.run"],
    "train": ["appliance.train.stage", "appliance.train.launcher", "appliance.train.result", "appliance.train.quality"],  # + its gate
    "export": ["appliance.deploy.export"],
    "quantize": ["appliance.deploy.quantize"],
    "compile": ["appliance.deploy.compile", COMPILER, "appliance.deploy.gpu", "appliance.deploy.openvino_route.build"],
    "package": ["appliance.deploy.package", "appliance.deploy.openvino_route.server_package"],
    "verify": ["appliance.deploy.verify", "appliance.deploy.openvino_route.server_verify"],
}

# Every string in our code that names one of our modules (imported with importlib, run with
# `python -m`, read as a package resource), with the reason it is a string. Such a name is also an
# edge of the import graph, so the layer rules apply to it.
STRING_IMPORTS = {
    **{("appliance.cli", verbs): "VERB_MODULES: the CLI registers each package's verbs with importlib"
       for verbs in ("appliance.doctor", "data_tools.cli", "appliance.train.cli", "appliance.tune.cli", "appliance.deploy.cli",
                     "appliance.pipeline.cli", "appliance.bundle.cli")},
    ("data_tools.cli", "data_tools.check.cli"): "DATA_VERB_MODULES: `appliance data` sub-verbs, with importlib",
    ("data_tools.cli", "data_tools.preview"): "DATA_VERB_MODULES: `appliance data` sub-verbs, with importlib",
    ("appliance.deploy.cli", "appliance.deploy.commands"): "the handlers of the deploy verbs (numpy, onnx), imported "
                                                             "when their verb runs",
    ("appliance.deploy.cli", "appliance.pipeline.qat"): "`quantize --qat` composes train, export and quantize; "
                                                         "its handler is the pipeline's, imported when it runs",
    ("appliance.tune.cli", "appliance.tune.commands"): "the handler of `appliance tune` (optuna, the launcher), imported "
                                                       "when its verb runs",
    ("data_tools.cli", "data_tools.commands"): "the handlers of `data index/cat/convert` (numpy, PIL), imported when "
                                               "their verb runs",
    ("appliance.train.launcher", "appliance.train.agent"): "run as `python -m` under torchrun: a process",
    ("appliance.train.launcher", "appliance.train.loop"): "each worker runs `python -m` under torchrun: a process",
    ("appliance.pipeline.demo", "appliance.pipeline"): "importlib.resources: the demo's pipeline config",
    ("appliance.tasks.detection", "appliance.tasks.detection_training"): "detection's torch side (samples, model, "
                                                                           "loss), imported when training runs",
    ("appliance.tasks.detection", "appliance.tasks.detection_metrics"): "detection's numpy side (COCO mAP, the gate), "
                                                                          "imported when figures are asked for",
    ("appliance.tasks.detection", "appliance.tasks.detection_decode"): "detection's decoding (numpy), imported when "
                                                                         "a deploy stage scores raw outputs",
    ("data_tools.augment_boxes", "data_tools.augment"): "a logger's name: joint augmentation logs with the image augmentation",
    ("data_tools.augment_masks", "data_tools.augment"): "a logger's name: joint augmentation logs with the image augmentation",
}


def string_imports(path: Path, module: str, root: Path) -> list[tuple[str, int]]:
    """(module named, line) for every string constant naming one of our modules other than this one."""
    found = []
    for value, line in scan(path)[1]:
        named = re.fullmatch(r"((?:appliance|data_tools)(?:\.\w+)+)(?::\w+)?", value)  # a module, or "module:function"
        if named and named.group(1) != module and _is_module(named.group(1), root):
            found.append((named.group(1), line))
    return found


def inner_order(where: str, module: str, target: str) -> list[str]:
    """The compiler's inner order and the stage modules' independence, for one import."""
    def under(name: str, prefix: str) -> bool:
        return name == prefix or name.startswith(prefix + ".")

    problems = [f"{where} imports {target}: {low} may not import {high} (kernels <- passes <- pipeline; "
                "tuning uses neither)"
                for low, highs in COMPILER_ORDER for high in highs if under(module, low) and under(target, high)]
    mine = {stage for stage, prefixes in STAGE_MODULES.items() if any(under(module, p) for p in prefixes)}
    theirs = {stage for stage, prefixes in STAGE_MODULES.items() if any(under(target, p) for p in prefixes)}
    if mine and theirs and not mine & theirs:
        problems.append(f"{where} imports {target}: the {min(mine)} stage imports the {min(theirs)} stage "
                        "(move what both need to a shared module)")
    return problems


def unlisted_string_imports(root: Path = ROOT) -> list[str]:
    """Strings naming our modules that STRING_IMPORTS does not list (and entries it lists for nothing)."""
    seen, problems = set(), []
    for path, module in sources(root):
        for target, line in string_imports(path, module, root):
            seen.add((module, target))
            if (module, target) not in STRING_IMPORTS:
                problems.append(f"{path.relative_to(root)}:{line}: {module} names the module {target!r} in a "
                                "string: list it in STRING_IMPORTS with the reason")
    problems += [f"STRING_IMPORTS lists {pair}, which no longer occurs" for pair in STRING_IMPORTS if pair not in seen]
    return problems


# The pipeline composes typed results: it may name its own files only, never a stage's.
PIPELINE = "appliance.pipeline"
PIPELINE_OWN_FILES = {"summary.json", "index.html", "pipeline.toml", "demo.toml", "demo_segmentation.toml",
                      "demo_detection.toml"}
FILE_NAME = re.compile(r"(?:^|/)([\w-][\w.-]*\.(?:json|jsonl|html|onnx|so|tar|npz|npy|toml|index|tfrecord|safetensors|"
                       r"png|csv|txt))$")
FILE_CONSTANT = re.compile(r"[A-Z][A-Z0-9_]*_(?:JSON|HTML|NAME|LIBRARY|MODEL|FILE|DIR)")


def pipeline_file_names(root: Path = ROOT) -> list[str]:
    """Places where a pipeline module spells a file name that is not its own, or reads a stage's
    file-name constant (COMPILE_JSON, REPORT_JSON, ...); core's MANIFEST_NAME is every stage's contract."""
    problems = []
    for path, module in sources(root):
        if not (module == PIPELINE or module.startswith(PIPELINE + ".")):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = None
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                m = FILE_NAME.search(node.value.strip())
                name = m.group(1) if m and m.group(1) not in PIPELINE_OWN_FILES else None
            elif isinstance(node, ast.ImportFrom) and not (node.module or "").startswith((PIPELINE, "appliance.core")):
                name = next((a.name for a in node.names if FILE_CONSTANT.fullmatch(a.name)), None)
            elif isinstance(node, ast.Attribute) and FILE_CONSTANT.fullmatch(node.attr) and node.attr != "MANIFEST_NAME":
                name = node.attr
            if name:
                problems.append(f"{path.relative_to(root)}:{node.lineno}: {module} names {name}, a stage's file; "
                                "read the path off that stage's result instead")
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
    (tmp_path / "appliance" / "train" / "planted.py").write_text("from appliance.deploy import export\n")
    (tmp_path / "data_tools" / "planted_a.py").write_text("import data_tools.planted_b\n")
    (tmp_path / "data_tools" / "planted_b.py").write_text("def f():\n    from data_tools import planted_a\n")
    problems = violations(tmp_path)
    assert any("appliance.train.planted" in p and "side by side" in p for p in problems), problems
    assert any(p.startswith("import cycle:") and "data_tools.planted_a" in p for p in problems), problems


def test_strings_naming_our_modules_are_all_in_the_one_allow_list():
    problems = unlisted_string_imports()
    assert not problems, "\n".join(problems)


def test_the_pipeline_names_no_stage_file():
    problems = pipeline_file_names()
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def tree_copy(tmp_path_factory):
    """A copy of the scanned tree to plant violations in (one planted file per test, removed after)."""
    import shutil

    root = tmp_path_factory.mktemp("tree")
    for package in SCANNED:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__"))
    return root


@pytest.fixture
def plant(tree_copy):
    planted = []

    def write(relative: str, text: str) -> Path:
        path = tree_copy / relative
        path.write_text(text)
        planted.append(path)
        return tree_copy

    yield write
    for path in planted:
        path.unlink()


def test_a_planted_kernel_importing_a_pass_fails(plant):
    root = plant("appliance/deploy/compiler/kernels/planted.py",
                 "from appliance.deploy.compiler.passes import int8_arith\n")
    assert any("compiler.kernels.planted" in p and "kernels <- passes" in p for p in violations(root))


def test_a_planted_tuning_module_importing_a_kernel_fails(plant):
    root = plant("appliance/deploy/compiler/tuning/planted.py",
                 "def f():\n    from appliance.deploy.compiler.kernels import common\n")
    assert any("compiler.tuning.planted" in p and "tuning uses neither" in p for p in violations(root))


@pytest.mark.parametrize("relative, text", [
    ("appliance/deploy/planted_package_step.py", ""),  # not a stage module: nothing to report
    ("appliance/deploy/verify_planted.py", "from appliance.deploy.export import find_model_dir\n"),
])
def test_only_stage_modules_are_held_to_the_stage_rule(plant, relative, text):
    root = plant(relative, text)
    assert not [p for p in violations(root) if "planted" in p]


def test_a_planted_stage_importing_another_stage_fails(plant, tree_copy):
    package = tree_copy / "appliance" / "deploy" / "package.py"
    original = package.read_text()
    try:
        package.write_text(original + "\nfrom appliance.deploy.verify import verify_package\n")
        assert any("appliance.deploy.package imports appliance.deploy.verify" in p and "the package stage imports "
                   "the verify stage" in p for p in violations(tree_copy))
    finally:
        package.write_text(original)
    root = plant("data_tools/check/planted.py", "")  # a module of the check package, not a stage module
    stage = tree_copy / "appliance" / "train" / "stage.py"
    original = stage.read_text()
    try:
        stage.write_text(original + "\nfrom data_tools.check.run import run_check\n")
        assert any("the train stage imports the check stage" in p for p in violations(root))
    finally:
        stage.write_text(original)


@pytest.mark.parametrize("source", [
    'import json\n\ndef load(out):\n    return json.loads((out / "compile-aarch64" / "compile.json").read_text())\n',
    'def report(check_dir):\n    return open(f"{check_dir}/report.json").read()\n',
    "from appliance.deploy.compile import COMPILE_JSON\n",
    "from appliance.deploy import compile\n\ndef library(d):\n    return d / compile.COMPILED_LIBRARY\n",
])
def test_a_planted_pipeline_naming_a_stage_file_fails(plant, source):
    root = plant("appliance/pipeline/planted.py", source)
    assert any("appliance/pipeline/planted.py" in p for p in pipeline_file_names(root)), source


def test_a_planted_string_import_must_be_listed(plant):
    root = plant("appliance/train/planted.py",
                 'import importlib\n\ndef f():\n    return importlib.import_module("appliance.deploy.compile")\n')
    assert any("appliance.train.planted names the module 'appliance.deploy.compile'" in p
               for p in unlisted_string_imports(root))
    # ...and it is an edge of the graph like any import: train may not reach into deploy through a string.
    assert any("appliance.train.planted" in p and "side by side" in p for p in violations(root))


@pytest.mark.parametrize("module, layer", [("appliance.core.errors", "core"), ("data_tools.tfrecord", "data"),
                                           ("data_tools.check.cli", "cli"), ("appliance.deploy.compile", "stages"),
                                           ("appliance.pipeline.runner", "pipeline")])
def test_layers_place_modules_as_documented(module, layer):
    assert LAYERS[place(module)[0]][0] == layer


# Imports of our own modules inside functions (docs/dev/architecture.md, rule 5): a module's
# dependencies are read at its top. The few left defer a module that imports torch, tvm, numpy or PIL
# at its top, where a light caller (`appliance --help`, reading a config) must not pay for it.
MAX_LATE_IMPORTS = 19
LATE = re.compile(r"#\s*late:\s*\S")


def late_imports(root: Path = ROOT, packages=PACKAGES) -> tuple[list[str], list[str]]:
    """(every in-function import of appliance or data_tools as 'file:line', those without a `# late: <reason>`
    comment on the line or the line above) in packages (appliance/ and data_tools/)."""
    found, unexplained = [], []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if path.parts[-2] == "edge" and path.name == "run.py":
                continue  # the edge package's own runner, run on the device
            text = path.read_text()
            lines = text.splitlines()
            for function in ast.walk(ast.parse(text, str(path))):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Import):
                        ours = any(a.name.split(".")[0] in PACKAGES for a in node.names)
                    elif isinstance(node, ast.ImportFrom):
                        ours = bool(node.level) or (node.module or "").split(".")[0] in PACKAGES
                    else:
                        continue
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    if not ours or where in found:  # a nested function's import is walked twice
                        continue
                    found.append(where)
                    nearby = lines[node.lineno - 1: node.end_lineno] + lines[max(node.lineno - 2, 0): node.lineno - 1]
                    if not any(LATE.search(line) for line in nearby):
                        unexplained.append(f"{where}: {lines[node.lineno - 1].strip()}")
    return found, unexplained


def test_few_imports_of_our_modules_sit_inside_functions_and_each_says_why():
    found, unexplained = late_imports()
    assert not unexplained, "imports of our modules inside a function without a `# late: <reason>` comment:\n" + \
        "\n".join(unexplained)
    assert len(found) <= MAX_LATE_IMPORTS, (f"{len(found)} imports of our modules inside functions, more than "
                                            f"{MAX_LATE_IMPORTS}; import at the top:\n" + "\n".join(found))


def test_a_planted_late_import_without_a_reason_fails(plant):
    root = plant("data_tools/planted.py", "def f():\n    from data_tools import tfrecord\n\n\n"
                 "def g():\n    # late: a reason on the line above\n    import data_tools.example\n")
    found, unexplained = late_imports(root)
    assert "data_tools/planted.py:2" in found and "data_tools/planted.py:7" in found
    assert [u for u in unexplained if "planted" in u] == ["data_tools/planted.py:2: from data_tools import tfrecord"]
    many = "".join(f"def f{i}():\n    import data_tools.tfrecord  # late: planted\n" for i in range(MAX_LATE_IMPORTS))
    root = plant("data_tools/planted_many.py", many)
    assert len(late_imports(root)[0]) > MAX_LATE_IMPORTS


# One verb, one function (docs/dev/contracts.md, "Stage results"): the handler of each stage verb calls the same
# stage function as the pipeline's plan (appliance/pipeline/plan.py), so no gate is implemented twice.
STAGE_VERBS = {  # (module, handler) -> the stage function it must call
    ("data_tools/check/cli.py", "check_command"): "check_stage",
    ("appliance/train/cli.py", "run"): "train_stage",
    ("appliance/deploy/commands.py", "export_command"): "export_stage",
    ("appliance/deploy/commands.py", "quantize_command"): "quantize_stage",
    ("appliance/deploy/commands.py", "compile_command"): "compile_stage",
    ("appliance/deploy/commands.py", "package_command"): "package_stage",
    ("appliance/deploy/commands.py", "verify_command"): "verify_stage",
}


def calls_in(path: Path, function: str) -> set[str]:
    """Names of the functions `function` in path calls (f(...) or module.f(...))."""
    tree = ast.parse(path.read_text(), str(path))
    node = next((n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function), None)
    if node is None:
        return set()
    return {c.func.id if isinstance(c.func, ast.Name) else c.func.attr for c in ast.walk(node)
            if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}


def verbs_off_their_stage(root: Path = ROOT) -> list[str]:
    plan_calls = {c.func.id if isinstance(c.func, ast.Name) else c.func.attr
                  for c in ast.walk(ast.parse((root / "appliance/pipeline/plan.py").read_text()))
                  if isinstance(c, ast.Call) and isinstance(c.func, (ast.Name, ast.Attribute))}
    problems = []
    for (path, handler), stage in STAGE_VERBS.items():
        if stage not in plan_calls:
            problems.append(f"appliance/pipeline/plan.py does not call {stage}")
        if stage not in calls_in(root / path, handler):
            problems.append(f"{path}:{handler} does not call {stage}, the function the pipeline runs")
    return problems


def test_each_stage_verb_calls_the_stage_function_the_pipeline_calls():
    problems = verbs_off_their_stage()
    assert not problems, "\n".join(problems)


def test_a_planted_verb_that_bypasses_its_stage_fails(plant, tree_copy):
    commands = tree_copy / "appliance" / "deploy" / "commands.py"
    original = commands.read_text()
    try:
        commands.write_text(original.replace("package_stage(args.compiled", "build_package(args.compiled"))
        assert any("package_command does not call package_stage" in p for p in verbs_off_their_stage(tree_copy))
    finally:
        commands.write_text(original)


# The pipeline's summary composes the stages' figures (docs/dev/architecture.md, rule 4): it reads a
# result's figures() and out_dir, never its other fields (a report dict, a val_acc under one task's name).
SUMMARY = "appliance/pipeline/summary.py"
RESULT_CONTRACT = {"out_dir", "figures", "load"}


def result_fields(root: Path = ROOT) -> set[str]:
    """Every field, property and method of every stage result class (a class with figures() and load())
    in appliance/ and data_tools/, but the contract's own names."""
    fields = set()
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for node in ast.walk(parsed(path)):
                if not isinstance(node, ast.ClassDef):
                    continue
                members = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
                members |= {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
                if {"figures", "load"} <= members:
                    fields |= members
    return fields - RESULT_CONTRACT


def summary_reads_beyond_figures(root: Path = ROOT) -> list[str]:
    """Places where the summary reads a result field other than figures() and out_dir. `results.<stage>`
    (the plan's Results picking a stage) is not such a read; `results.<stage>.<field>` is."""
    fields, problems = result_fields(root), []
    for node in ast.walk(ast.parse((root / SUMMARY).read_text(), SUMMARY)):
        if isinstance(node, ast.Attribute) and node.attr in fields and not (
                isinstance(node.value, ast.Name) and node.value.id == "results"):
            problems.append(f"{SUMMARY}:{node.lineno}: reads .{node.attr} of a stage result; compose its figures()")
    return problems


def test_the_summary_composes_figures_only():
    assert {"report", "info", "quality", "parity", "val_acc"} <= result_fields()  # the rule sees the results
    problems = summary_reads_beyond_figures()
    assert not problems, "\n".join(problems)


def test_a_planted_summary_reading_a_report_fails(tree_copy):
    summary = tree_copy / SUMMARY
    original = summary.read_text()
    try:
        summary.write_text(original + "\n\ndef planted(results):\n    return results.quantize.report['fp32']\n")
        assert any(".report of a stage result" in p for p in summary_reads_beyond_figures(tree_copy))
    finally:
        summary.write_text(original)


# Each stage file name is spelled in one module, the one that writes it and defines its constant
# (docs/dev/architecture.md, rule 4); every other module imports that constant or reads the path off
# the stage's result. report.json / report.html are the names of two stages' reports (data check,
# training). benchmarks/ and installer/ read outputs as a user does and are not held to it.
STAGE_FILES = {
    "report.json": {"data_tools/check/run.py", "appliance/train/report.py", "appliance/tune/report.py"},
    "report.html": {"data_tools/check/run.py", "appliance/train/report.py", "appliance/tune/report.py"},
    "metrics.jsonl": {"appliance/train/result.py"},
    "quality.json": {"appliance/train/quality.py"},
    "parity.json": {"appliance/deploy/export.py"},
    "parity.html": {"appliance/deploy/export.py"},
    "accuracy.json": {"appliance/deploy/accuracy_report.py"},  # quantize's, and each GPU build's
    "accuracy.html": {"appliance/deploy/accuracy_report.py"},
    "compile.json": {"appliance/deploy/compiled.py"},  # every compile target's (TVM, GPU routes)
    "package.json": {"appliance/deploy/package.py"},
    "verify.json": {"appliance/deploy/verify.py"},
    "verify.html": {"appliance/deploy/verify.py"},
    "summary.json": {"appliance/pipeline/summary.py"},
}


def stage_file_spellings(root: Path = ROOT) -> list[str]:
    """Places outside a stage file's owner that spell its name in a string (docstrings aside)."""
    problems = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = parsed(path)
            docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                          if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                          and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                    m = FILE_NAME.search(node.value.strip().rstrip(")"))
                    if m and m.group(1) in STAGE_FILES and rel not in STAGE_FILES[m.group(1)]:
                        problems.append(f"{rel}:{node.lineno}: spells {m.group(1)}, which "
                                        f"{' / '.join(sorted(STAGE_FILES[m.group(1)]))} owns: import its constant")
    return problems


def test_each_stage_file_name_is_spelled_by_its_stage_alone():
    problems = stage_file_spellings()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("source", [
    'def record(out):\n    return out / "compile.json"\n',
    'def log(run_dir):\n    return open(f"{run_dir}/metrics.jsonl")\n',
])
def test_a_planted_stage_file_name_outside_its_stage_fails(plant, source):
    root = plant("appliance/deploy/planted.py", source)
    assert any(p.startswith("appliance/deploy/planted.py") for p in stage_file_spellings(root)), source


# Heavy third-party libraries inside functions (docs/dev/architecture.md, rule 5): where a module must
# import without them (a light caller, an optional library). Counted, so that a new one is a choice;
# raise the ceiling with the reason in the commit when a module needs one more.
HEAVY = ("torch", "torchvision", "tvm", "tvm_ffi", "onnxruntime", "onnx", "tensorflow", "tensorrt", "numpy",
         "PIL", "safetensors", "sklearn", "scipy")
MAX_LATE_HEAVY = 242


def late_heavy_imports(root: Path = ROOT) -> list[str]:
    """'file:line' of every import of a HEAVY library inside a function in appliance/ and data_tools/."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            for function in ast.walk(parsed(path)):
                if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                for node in ast.walk(function):
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and not node.level:
                        names = [node.module or ""]
                    else:
                        continue
                    where = f"{path.relative_to(root)}:{node.lineno}"
                    if any(n.split(".")[0] in HEAVY for n in names) and where not in found:
                        found.append(where)
    return found


def test_heavy_late_imports_are_counted():
    found = late_heavy_imports()
    assert len(found) <= MAX_LATE_HEAVY, (f"{len(found)} imports of heavy libraries inside functions, more than "
                                          f"{MAX_LATE_HEAVY}: import at the top where every caller needs it")


def test_a_planted_heavy_late_import_is_counted(plant):
    before = len(late_heavy_imports(plant("data_tools/planted.py", "")))
    root = plant("data_tools/planted_heavy.py", "def f():\n    import numpy as np\n    from torch import nn\n")
    assert len(late_heavy_imports(root)) == before + 2


# benchmarks/ are scripts whose one file is both the light parent (alternating rounds, starting processes,
# writing the figures) and the worker each round runs: the worker's imports of torch and of our modules
# sit in the worker's functions so that the parent stays light. Counted, like the library's.
MAX_LATE_IMPORTS_BENCHMARKS = 47


def test_benchmarks_imports_of_our_modules_are_counted(plant):
    found = late_imports(packages=("benchmarks",))[0]
    assert len(found) <= MAX_LATE_IMPORTS_BENCHMARKS, "\n".join(found)
    root = plant("benchmarks/planted.py", "def f():\n    from appliance.core import errors\n")
    assert "benchmarks/planted.py:2" in late_imports(root, packages=("benchmarks",))[0]
