"""The locks in manifests/ must match their .in files and pyproject.toml (no resolver run)."""

import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
LOCK_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s\\;]+)", re.M)


def read_in(path: Path) -> list[Requirement]:
    reqs = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            reqs.append(Requirement(line))
    return reqs


def read_lock(path: Path) -> dict[str, tuple[Version, int]]:
    """name -> (version, number of hashes) for every pin in a pip-tools lock."""
    text = path.read_text()
    pins = {}
    blocks = re.split(r"\n(?=[A-Za-z0-9])", text)
    for block in blocks:
        m = LOCK_PIN.match(block)
        if m:
            pins[canonicalize_name(m.group(1))] = (Version(m.group(2)), block.count("--hash=sha256:"))
    return pins


LOCKS = sorted(MANIFESTS.glob("*.in"))


def locks_of(in_file: Path) -> list[Path]:
    """NAME.lock, and NAME-pyX.Y.lock for each further Python a bundle profile serves (profiles.toml)."""
    return [in_file.with_suffix(".lock"), *sorted(MANIFESTS.glob(f"{in_file.stem}-py*.lock"))]


@pytest.mark.parametrize("in_file", LOCKS, ids=lambda p: p.stem)
def test_lock_pins_every_requirement_of_its_in_file(in_file):
    problems = []
    for lock in locks_of(in_file):
        assert lock.exists(), f"{lock.name} missing: compile it (see manifests/README.md)"
        problems += _out_of_step(in_file, lock)
    assert not problems, "lock out of step, recompile it:\n" + "\n".join(problems)


def _out_of_step(in_file: Path, lock: Path) -> list[str]:
    pins = read_lock(lock)
    problems = []
    for req in read_in(in_file):
        name = canonicalize_name(req.name)
        if name not in pins:
            problems.append(f"{req} is in {in_file.name} but not pinned in {lock.name}")
        elif req.specifier and not req.specifier.contains(pins[name][0], prereleases=True):
            problems.append(f"{req} in {in_file.name} excludes the pinned {name}=={pins[name][0]}")
    return problems


@pytest.mark.parametrize("in_file", LOCKS, ids=lambda p: p.stem)
def test_lock_is_hashed_and_says_how_to_remake_it(in_file):
    for lock in locks_of(in_file):
        header = lock.read_text().splitlines()[:3]
        assert any(f"manifests/{in_file.name}" in line and "--generate-hashes" in line
                   and f"-o manifests/{lock.name}" in line for line in header), header
        unhashed = [name for name, (_, hashes) in read_lock(lock).items() if hashes == 0]
        assert not unhashed, f"pins without hashes in {lock.name}: {unhashed}"


def test_pyproject_dependencies_are_in_the_dev_lock():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = read_lock(MANIFESTS / "dev.lock")
    wanted = [Requirement(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]]
    problems = [str(r) for r in wanted
                if canonicalize_name(r.name) not in pins
                or not r.specifier.contains(pins[canonicalize_name(r.name)][0], prereleases=True)]
    assert not problems, f"pyproject.toml asks for what manifests/dev.lock does not satisfy: {problems}"


def test_lock_parser_sees_a_broken_lock(tmp_path):
    """The checks above must be able to fail: a stale pin is caught."""
    (tmp_path / "x.in").write_text("numpy>=99\n")
    (tmp_path / "x.lock").write_text("numpy==2.0.0 \\\n    --hash=sha256:" + "0" * 64 + "\n")
    req = read_in(tmp_path / "x.in")[0]
    version, hashes = read_lock(tmp_path / "x.lock")["numpy"]
    assert hashes == 1 and not req.specifier.contains(version)


# Imports that pyproject.toml need not declare: the bundle builder's tools (a build host's, from
# manifests/dev.in, never installed on an appliance by the package), the edge package's own copy of
# preprocessing.py, and TensorRT (the GPU image's, probed by appliance/deploy/gpu/routes.py).
UNDECLARED = {"cryptography", "cyclonedx", "packageurl", "packaging", "preprocessing", "tensorrt"}


def test_every_third_party_import_is_a_pyproject_dependency():
    """onnx2torch ([model] init from ONNX) was imported but not declared: a pip install of the package
    alone lacked it. Every module appliance/ and data_tools/ import is stdlib, ours, or declared."""
    import ast
    import importlib.metadata
    import sys

    imported = set()
    for package in ("appliance", "data_tools"):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported |= {alias.name.split(".")[0] for alias in node.names}
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"appliance", "data_tools"} - UNDECLARED
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    # An optional route's libraries (the `openvino` extra: openvino, nncf) are declared as its extra;
    # the test-only `dev` extra declares nothing the product imports.
    optional = [r for extra, reqs in project.get("optional-dependencies", {}).items() if extra != "dev" for r in reqs]
    declared = {canonicalize_name(Requirement(r).name) for r in [*project["dependencies"], *optional]}
    distributions = importlib.metadata.packages_distributions()
    missing = sorted(m for m in third_party
                     if not {canonicalize_name(d) for d in distributions.get(m, [])} & declared)
    assert missing == [], f"imported but not in pyproject.toml's dependencies: {missing}"
