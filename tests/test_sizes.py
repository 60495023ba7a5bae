"""No module over ~400 lines and no function over ~80 in appliance/, data_tools/, benchmarks/ and
installer/ (docs/dev/style.md: a module past ~400 lines is a sign that it holds two concerns), unless the
allow-list below, or a line `Size: <reason>` in the module's docstring, says why. Everything is held,
the compiler, the training loop, the benchmarks and the offline installer included.

installer/ is also held to the standard library (test_the_installer_imports_the_standard_library_only):
it runs on the site's bare python3 before any venv exists, from the files the bundle carries
(INSTALLER_FILES in appliance/bundle/build.py), so nothing else is importable there.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("appliance", "data_tools", "benchmarks", "installer")
MAX_MODULE_LINES, MAX_FUNCTION_LINES = 400, 80

# (path, function or None for the module) -> why it is longer, in one line.
ALLOWED = {
    ("appliance/train/config.py", None): "the training config's schema: every section and key with its type, default "
                                         "and bound in one place, read top to bottom as the reference of the TOML file",
    ("appliance/core/minisign.py", None): "travels alone into the bundle, where the installer runs it with the standard "
                                          "library only: keys, signatures, Ed25519 verify and sign in one file",
    ("data_tools/example.py", None): "the Example codec: descriptor, the fast canonical decoder and the full "
                                     "parser's fallback must agree field for field, read side by side",
    ("data_tools/example.py", "_decode_example_fast"): "one inlined loop over the wire format: a call per "
                                                       "field costs more than the decode (measured in "
                                                       "benchmarks/ingest.py)",
    ("data_tools/tfrecord.py", None): "the verified reader and its damage scanner share the framing state",
    ("data_tools/tfrecord.py", "_records"): "one generator for every public form of the reader: a wrapper "
                                            "generator costs ~10% of the hot path",
    ("installer/install_bundle.py", None): "one of the few files that cross the air gap and run on the site's bare "
                                           "python3 (INSTALLER_FILES): the install steps in one script, read by "
                                           "the site's auditor top to bottom next to verify_bundle.py",
}
INSTALLER_SIBLINGS = {"verify_bundle", "minisign", "install_bundle"}  # carried beside it (INSTALLER_FILES)


def _reason_in_docstring(tree: ast.Module) -> bool:
    doc = ast.get_docstring(tree) or ""
    return any(line.strip().startswith("Size:") and len(line.strip()) > len("Size:") + 3 for line in doc.splitlines())


def offenders(root: Path = ROOT) -> list[tuple[str, str | None, int]]:
    """(path, function or None, lines) for every module and function over the limits, not excused."""
    found = []
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            text = path.read_text()
            tree = ast.parse(text, rel)
            if _reason_in_docstring(tree):
                continue
            if len(text.splitlines()) > MAX_MODULE_LINES:
                found.append((rel, None, len(text.splitlines())))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = node.end_lineno - node.lineno + 1
                    if lines > MAX_FUNCTION_LINES:
                        found.append((rel, node.name, lines))
    return found


def test_no_module_or_function_is_over_the_limits_without_a_reason():
    unexcused = [f"{path}{':' + name if name else ''}: {lines} lines" for path, name, lines in offenders()
                 if (path, name) not in ALLOWED]
    assert not unexcused, ("over ~400 lines per module / ~80 per function; split it, or give the reason in "
                           "ALLOWED or a `Size:` line of the module docstring:\n" + "\n".join(unexcused))


def test_the_allow_list_holds_only_what_is_still_long():
    still_long = {(path, name) for path, name, _ in offenders()}
    stale = [key for key in ALLOWED if key not in still_long]
    assert not stale, f"no longer over the limits, remove from ALLOWED: {stale}"
    assert all(len(reason) > 20 for reason in ALLOWED.values())


def test_a_planted_long_function_and_module_are_found(tmp_path):
    (tmp_path / "appliance").mkdir()
    (tmp_path / "data_tools").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES + 1))
    (tmp_path / "appliance" / "planted.py").write_text(f'"""A planted module."""\n\n\ndef long():\n{body}\n')
    (tmp_path / "data_tools" / "excused.py").write_text(
        f'"""An excused module.\n\nSize: a planted reason, long enough to count.\n"""\n\n\ndef long():\n{body}\n')
    (tmp_path / "data_tools" / "big.py").write_text("\n".join(f"x{i} = {i}" for i in range(MAX_MODULE_LINES + 1)))
    found = {(path, name) for path, name, _ in offenders(tmp_path)}
    assert found == {("appliance/planted.py", "long"), ("data_tools/big.py", None)}


def installer_imports(root: Path = ROOT) -> list[str]:
    """Imports in installer/*.py of anything but the standard library and the installer's own files."""
    import sys

    problems = []
    for path in sorted((root / "installer").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            problems += [f"{path.relative_to(root)}:{node.lineno}: imports {n}" for n in names
                         if n.split(".")[0] not in sys.stdlib_module_names | INSTALLER_SIBLINGS]
    return problems


def test_the_installer_imports_the_standard_library_only(tmp_path):
    problems = installer_imports()
    assert not problems, "installer/ runs before any venv exists:\n" + "\n".join(problems)
    (tmp_path / "installer").mkdir()
    (tmp_path / "installer" / "planted.py").write_text("import json\n\ndef f():\n    import numpy\n")
    assert installer_imports(tmp_path) == ["installer/planted.py:4: imports numpy"]


def test_benchmarks_and_the_installer_are_held_too(tmp_path):
    for folder in ("benchmarks", "installer"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "big.py").write_text("\n".join(f"x{i} = {i}" for i in range(MAX_MODULE_LINES + 1)))
    assert {(path, name) for path, name, _ in offenders(tmp_path)} == {("benchmarks/big.py", None),
                                                                    ("installer/big.py", None)}
