"""Shared by tests/bundle and tests/installer: real bundles of the `test` profile, built once.

Building downloads the profile's few small wheels from PyPI (the connected-host side); every
install then runs under `unshare -n`. Bundles of other versions are built from a copy of the
source tree with the version changed, as a release engineer would.
"""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from conftest import ROOT, VENV_BIN, offline_cmd

INSTALL_SH = ROOT / "installer" / "install.sh"
# The interpreter the test venv was made from: install.sh builds its venvs with it.
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
_built: dict[str, Path] = {}


def user_env() -> dict:
    """What a user's shell has: no PYTHONPATH pointing into this checkout."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def source_copy(dest: Path, version: str, break_cli: bool = False, without_uv: bool = False) -> Path:
    """A copy of this checkout's project files with the version set.

    break_cli: `appliance` fails on start (a bad release); without_uv: the test profile's lock
    has no uv, so the installer must fall back to pip.
    """
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ROOT / name, dest / name)
    for name in ("appliance", "data_tools", "manifests", "installer"):
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    py = dest / "pyproject.toml"
    py.write_text(re.sub(r'(?m)^version = ".*"', f'version = "{version}"', py.read_text()))
    init = dest / "appliance" / "__init__.py"
    init.write_text(re.sub(r'__version__ = ".*"', f'__version__ = "{version}"', init.read_text()))
    if break_cli:
        cli = dest / "appliance" / "cli.py"
        cli.write_text(cli.read_text() + '\nraise ImportError("deliberately broken build")\n')
    if without_uv:
        for lock in (dest / "manifests").glob("test*.lock"):  # every Python's lock of the profile
            lock.write_text(re.sub(r"(?m)^uv==.*\n(?:\s+.*\n)*", "", lock.read_text()))
    return dest


def build(out: Path, *args: str, source: Path | None = None, cache: Path,
          env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [str(VENV_BIN / "appliance"), "bundle", "build", "--out", str(out), "--cache", str(cache), *args]
    if source is not None:
        cmd += ["--source", str(source)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def cached_wheels(factory) -> list[Path]:
    """The real wheels the session's test-profile bundle fetched from the index (its download cache)."""
    bundle(factory)
    return sorted((factory.getbasetemp() / "bundles" / "cache").glob("*/*.whl"))


def keys(base: Path) -> tuple[Path, Path]:
    """(secret key, public key) made by `appliance bundle keygen`, once per base directory."""
    key, pub = base / "site.key", base / "site.pub"
    if not key.exists():
        proc = subprocess.run([str(VENV_BIN / "appliance"), "bundle", "keygen", "--out", str(base / "site")],
                              capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
    return key, pub


def bundle(factory, version: str = "0.1.0", broken: bool = False, without_uv: bool = False) -> Path:
    """The signed test-profile bundle of version (built once per session)."""
    tag = f"{version}{'-broken' if broken else ''}{'-without-uv' if without_uv else ''}"
    if tag not in _built:
        base = factory.getbasetemp() / "bundles"
        base.mkdir(exist_ok=True)
        key, _ = keys(base)
        src = source_copy(factory.mktemp(f"src-{tag}"), version, broken, without_uv)
        proc = build(base / tag, "--profile", "test", "--sign-key", str(key), source=src, cache=base / "cache")
        assert proc.returncode == 0, proc.stderr
        _built[tag] = base / tag / f"appliance-bundle-{version}.tar"
    return _built[tag]


def public_key(factory) -> Path:
    return keys(factory.getbasetemp() / "bundles")[1]


def install(bundle_tar: Path, prefix: Path, *args: str, pubkey: Path | None = None,
            python: str = BASE_PYTHON) -> subprocess.CompletedProcess:
    """installer/install.sh under `unshare -n`, from a user's shell (no PYTHONPATH)."""
    cmd = [str(INSTALL_SH), str(bundle_tar), "--prefix", str(prefix), "--python", str(python), *args]
    if pubkey is not None:
        cmd += ["--pubkey", str(pubkey)]
    return subprocess.run(offline_cmd(cmd), capture_output=True, text=True, timeout=600, env=user_env())


def installed(prefix: Path, *args: str) -> subprocess.CompletedProcess:
    """Run the installed `appliance` offline, as a user would."""
    cmd = [str(prefix / "current" / "venv" / "bin" / "appliance"), *args]
    return subprocess.run(offline_cmd(cmd), capture_output=True, text=True, timeout=300, env=user_env(),
                          cwd=prefix)


def state(prefix: Path) -> dict:
    """What a later install could have changed: links, releases and their records, stray files."""
    entries = sorted(p.name for p in prefix.iterdir()) if prefix.exists() else []
    links = {n: os.readlink(prefix / n) for n in ("current", "previous") if (prefix / n).is_symlink()}
    releases = prefix / "releases"
    records = {r.name: (r / "install.json").read_bytes() for r in releases.iterdir()} if releases.exists() else {}
    return {"entries": entries, "links": links, "records": records}


def rewrite_tar(src: Path, dest: Path, change=None, extra: list[tarfile.TarInfo] | None = None,
                extra_data: dict[str, bytes] | None = None, sums_extra: dict[str, str] | None = None) -> Path:
    """Copy a bundle tar member by member; change(name, data) may return new data; extra members are added.

    sums_extra adds lines to SHA256SUMS, as an attacker who also rewrote the checksums would.
    """
    extra_data = extra_data or {}
    with tarfile.open(src) as tin, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as tout:
        for member in tin.getmembers():
            data = tin.extractfile(member).read() if member.isfile() else None
            if change is not None and data is not None:
                data = change(member.name, data)
            if sums_extra and member.name.endswith("/SHA256SUMS"):
                data += "".join(f"{h}  {n}\n" for n, h in sums_extra.items()).encode()
            if data is not None:
                member.size = len(data)
                tout.addfile(member, io.BytesIO(data))
            else:
                tout.addfile(member)
        for member in extra or []:
            data = extra_data.get(member.name)
            tout.addfile(member, io.BytesIO(data) if data is not None else None)
    return dest


def pip_env(index_url: str) -> dict:
    """This environment with index_url as pip's only package index: no pip.conf, find-links or extra indexes."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    return {**env, "PIP_CONFIG_FILE": os.devnull, "PIP_INDEX_URL": index_url}


def simple_index(root: Path, wheels: list[Path]) -> Path:
    """A PEP 503 HTML-only index of wheels under root: simple/<name>/index.html -> files/<wheel>#sha256=..."""
    import hashlib
    import html

    from packaging.utils import canonicalize_name, parse_wheel_filename

    (root / "files").mkdir(parents=True)
    projects: dict[str, list[str]] = {}
    for wheel in wheels:
        shutil.copy2(wheel, root / "files" / wheel.name)
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        name = canonicalize_name(parse_wheel_filename(wheel.name)[0])
        projects.setdefault(name, []).append(
            f'<a href="../../files/{html.escape(wheel.name)}#sha256={digest}">{html.escape(wheel.name)}</a><br>')
    for name, links in projects.items():
        (root / "simple" / name).mkdir(parents=True)
        (root / "simple" / name / "index.html").write_text(
            f"<!DOCTYPE html><html><body><h1>Links for {name}</h1>{''.join(links)}</body></html>\n")
    (root / "simple" / "index.html").write_text(
        "<!DOCTYPE html><html><body>" + "".join(f'<a href="{n}/">{n}</a><br>' for n in sorted(projects))
        + "</body></html>\n")
    return root


class Served:
    """`python -m http.server` over a directory on loopback; .url is its base, .log what it was asked."""

    def __init__(self, root: Path):
        self.root = root

    def __enter__(self) -> "Served":
        self.log_file = open(self.root.parent / f"{self.root.name}.http.log", "w+")
        self.proc = subprocess.Popen([sys.executable, "-u", "-m", "http.server", "0", "--bind", "127.0.0.1",
                                      "--directory", str(self.root)], stdout=subprocess.PIPE, stderr=self.log_file,
                                     text=True)
        line = self.proc.stdout.readline()  # "Serving HTTP on 127.0.0.1 port N (http://127.0.0.1:N/) ..."
        port = re.search(r"port (\d+)", line)
        assert port, f"http.server did not start: {line!r}"
        self.url = f"http://127.0.0.1:{port.group(1)}"
        return self

    def log(self) -> str:
        self.log_file.seek(0)
        return self.log_file.read()

    def __exit__(self, *exc) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.proc.stdout.close()
        self.log_file.close()
