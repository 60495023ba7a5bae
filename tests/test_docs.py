"""The docs cannot drift: config tables against the dataclasses, options against the parser, links, README size."""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
import typing
from pathlib import Path

import pytest

from appliance.pipeline.config import PipelineConfig
from appliance.train.config import Config

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
ROW = re.compile(r"^\| `\[(?P<section>\w+)\] (?P<key>\w+)` \| (?P<default>[^|]+?) \|")


def sections_of(config_cls) -> dict[str, type]:
    """{section name: dataclass} of a config: its fields whose type is itself a dataclass."""
    hints = typing.get_type_hints(config_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(config_cls) if dataclasses.is_dataclass(hints[f.name])}


def documented_keys(page: Path) -> dict[tuple[str, str], str]:
    """{(section, key): default cell} from the page's `| `[section] key` | default | meaning |` rows."""
    rows = {}
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.startswith("| `["):
            match = ROW.match(line)
            assert match, f"{page.name}:{number}: a config row must name one `[section] key`: {line}"
            where = (match["section"], match["key"])
            assert where not in rows, f"{page.name}:{number}: [{where[0]}] {where[1]} documented twice"
            rows[where] = match["default"].strip()
    return rows


def parse_default(cell: str, where: str):
    """The table's default cell: `required`, or one TOML value in backticks."""
    if cell == "required":
        return dataclasses.MISSING
    match = re.fullmatch(r"`(.+)`", cell)
    assert match, f"{where}: default {cell!r} is neither `required` nor a TOML value in backticks"
    value = tomllib.loads(f"v = {match[1]}")["v"]
    return tuple(value) if isinstance(value, list) else value


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def compare_table(page: Path, sections: dict[str, type]) -> None:
    rows = documented_keys(page)
    expected = {(name, f.name): f for name, cls in sections.items() for f in dataclasses.fields(cls)}
    missing = sorted(set(expected) - set(rows))
    extra = sorted(set(rows) - set(expected))
    assert not missing, f"{page.name}: keys in the config dataclasses but not in the table: {missing}"
    assert not extra, f"{page.name}: keys in the table but not in the config dataclasses: {extra}"
    for where, f in expected.items():
        label = f"{page.name}: [{where[0]}] {where[1]}"
        documented, actual = parse_default(rows[where], label), field_default(f)
        assert documented == actual, f"{label}: the table says {rows[where]}, the dataclass {actual!r}"
        if actual is not dataclasses.MISSING:
            assert isinstance(documented, bool) == isinstance(actual, bool), f"{label}: bool vs number"


def test_train_config_table_matches_the_dataclasses():
    sections = sections_of(Config)
    assert {"run", "data", "train", "augment"} <= set(sections)
    compare_table(DOCS / "train.md", sections)


def test_pipeline_config_table_matches_the_dataclasses():
    sections = sections_of(PipelineConfig)
    assert {"pipeline", "check", "verify"} <= set(sections)
    compare_table(DOCS / "pipeline.md", sections)


def test_the_table_check_fails_on_a_wrong_default(tmp_path):
    page = tmp_path / "train.md"
    page.write_text((DOCS / "train.md").read_text().replace("| `[train] batch_size` | `32` |",
                                                            "| `[train] batch_size` | `64` |"))
    with pytest.raises(AssertionError, match=r"\[train\] batch_size: the table says `64`"):
        compare_table(page, sections_of(Config))
    page.write_text("| `[train] epochs` | `1` | run length |\n")
    with pytest.raises(AssertionError, match="not in the table"):
        compare_table(page, sections_of(Config))


def data_check_options() -> dict[str, object]:
    from data_tools.check.cli import register_data_verb

    parser = argparse.ArgumentParser()
    register_data_verb(parser.add_subparsers())
    check = parser._subparsers._group_actions[0].choices["check"]
    return {a.option_strings[-1]: (dataclasses.MISSING if a.required else a.default)
            for a in check._actions if a.option_strings and a.option_strings[-1] != "--help"}


def test_data_check_options_table_matches_the_parser():
    rows = {}
    for line in (DOCS / "check.md").read_text().splitlines():
        match = re.match(r"^\| `(--[\w-]+)` \| ([^|]+?) \|", line)
        if match:
            rows[match[1]] = match[2].strip()
    options = data_check_options()
    assert set(rows) == set(options), f"check.md options {sorted(rows)} vs the parser's {sorted(options)}"
    for option, cell in rows.items():
        actual = options[option]
        if cell == "required" or actual is dataclasses.MISSING:
            assert (cell == "required") == (actual is dataclasses.MISSING), f"check.md {option}: {cell}"
        elif cell.startswith("`"):  # a literal default; prose ("one per file, ...") describes a None default
            assert parse_default(cell, f"check.md {option}") == actual, f"check.md {option}: {cell} vs {actual!r}"
        else:
            assert actual in (None, False, []), f"check.md {option}: default {actual!r} needs a literal, not {cell!r}"


def test_readme_is_short_and_keeps_the_ci_markers():
    text = README.read_text()
    assert len(text.splitlines()) <= 120, "README.md is the five-minute page: reference goes to docs/"
    for marker in ("<!-- main-command -->", "<!-- test-command -->"):
        assert text.count(marker) == 1, marker
        after = text.split(marker, 1)[1].lstrip("\n").splitlines()
        assert after[0] == "```" and after[1].startswith("installer/bootstrap.sh ") and after[2] == "```", marker


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", [README, *sorted(DOCS.glob("*.md"))], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_point_to_existing_files_and_headings(page):
    for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        assert file.exists(), f"{page.name}: link to {target}: no such file"
        if anchor:
            headings = [slug(h) for h in re.findall(r"^#+ (.+)$", file.read_text(), re.M)]
            assert anchor in headings, f"{page.name}: link to {target}: no such heading in {file.name}"


def test_every_docs_page_is_in_the_index():
    index = (DOCS / "README.md").read_text()
    for page in DOCS.glob("*.md"):
        if page.name != "README.md":
            assert f"]({page.name})" in index, f"docs/README.md does not list {page.name}"


# Every repository path a page, a docstring or a comment cites exists (a `*` in it: some file matches).
# Paths under the bundle's layout are not the repository's: the bundle carries appliance/core/minisign.py
# as installer/minisign.py (appliance/bundle/build.py, INSTALLER_FILES).
CITED_TOPS = ("appliance", "data_tools", "tests", "benchmarks", "installer", "docs", "manifests")
CITED_PATH = re.compile(r"(?<![\w./$<{-])((?:%s)/[\w./*-]*[\w/*])" % "|".join(CITED_TOPS))
BUNDLE_PATHS = {"installer/minisign.py"}


def prose_of_python(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the docstrings and comments of a Python file."""
    import ast
    import io
    import tokenize

    text = path.read_text()
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(text).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                found += [(node.body[0].lineno + i, line) for i, line in enumerate(doc.splitlines())]
    return found


def missing_cited_paths(root: Path = ROOT) -> list[str]:
    sources = [(p, list(enumerate(p.read_text().splitlines(), 1)))
               for p in [*root.glob("*.md"), *root.glob("docs/**/*.md"), *root.glob("benchmarks/*.md")]]
    sources += [(p, prose_of_python(p)) for top in CITED_TOPS[:5] for p in sorted((root / top).rglob("*.py"))]
    problems = []
    for path, lines in sources:
        for number, line in lines:
            for match in CITED_PATH.finditer(line):
                cited = match.group(1).rstrip(".")
                exists = any(root.glob(cited)) if "*" in cited else (root / cited).exists()
                if not exists and cited not in BUNDLE_PATHS:
                    problems.append(f"{path.relative_to(root)}:{number}: {cited} is not in the repository")
    return problems


def test_every_cited_repository_path_exists():
    problems = missing_cited_paths()
    assert not problems, "\n".join(problems)


def test_a_planted_citation_of_a_missing_file_fails(tmp_path):
    (tmp_path / "docs" / "dev").mkdir(parents=True)
    (tmp_path / "appliance").mkdir()
    (tmp_path / "appliance" / "real.py").write_text('"""See appliance/real.py and appliance/gone.py."""\n# and docs/dev/*.md\n')
    (tmp_path / "docs" / "dev" / "page.md").write_text("the contracts: docs/dev/contracts.md; appliance/re*.py\n")
    assert missing_cited_paths(tmp_path) == ["docs/dev/page.md:1: docs/dev/contracts.md is not in the repository",
                                             "appliance/real.py:1: appliance/gone.py is not in the repository"]


def test_the_readme_first_command_fetches_what_the_demo_device_estimate_needs():
    """issue 43: the README's first command ended its demo with "device estimate aarch64: not estimated:
    wheelhouse/edge-sysroot-arm64 missing". The demo's configs compile for aarch64 with the device
    estimate on, which runs the build in an arm64 Python under qemu (appliance/deploy/edge/cycles.py:
    the edge sysroot's python3.11 and the edge wheels); the first command must fetch both."""
    from appliance.deploy.edge import cycles
    from appliance.pipeline.config import CompileSection

    command = README.read_text().split("<!-- main-command -->", 1)[1].lstrip("\n").splitlines()[1]
    flags = set(command.split("&&")[0].split()[1:])
    for demo in ("demo.toml", "demo_segmentation.toml"):
        cfg = tomllib.loads((ROOT / "appliance" / "pipeline" / demo).read_text())
        assert any(t.startswith("aarch64") for t in cfg["compile"]["targets"])
        assert cfg["compile"].get("device_estimate", CompileSection.device_estimate), demo
    needs = {"edge-sysroot-arm64": "--edge-sysroot", "edge-aarch64": "--edge-wheels"}
    source = Path(cycles.__file__).read_text()
    for folder, flag in needs.items():
        assert f'wheelhouse("{folder}")' in source  # what the estimate reads
        assert flag in flags, f"README's first command lacks {flag} (wheelhouse/{folder}, which the device estimate needs)"
    assert "--system" in flags  # qemu-user, llvm-16 and the qemu plugin header
