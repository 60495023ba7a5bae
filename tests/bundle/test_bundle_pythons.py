"""A bundle serving CPython 3.11 and 3.12: the installer takes the lock of the interpreter it finds."""

import glob
import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

import bundle_kit


def installed_lock_python(prefix) -> str:
    header = (prefix / "current" / "bundle" / "requirements.lock").read_text().splitlines()[1]
    return header.split("--python-version ", 1)[1].split()[0]


def venv_python(prefix) -> str:
    proc = subprocess.run([str(prefix / "current" / "venv" / "bin" / "python"), "-c",
                           "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True)
    return proc.stdout.strip()


def test_this_hosts_python_gets_its_own_lock(tmp_path, tmp_path_factory):
    tar, pub = bundle_kit.bundle(tmp_path_factory), bundle_kit.public_key(tmp_path_factory)
    proc = bundle_kit.install(tar, tmp_path / "p", pubkey=pub)
    assert proc.returncode == 0, proc.stderr
    here = "%d.%d" % sys.version_info[:2]
    assert installed_lock_python(tmp_path / "p") == here == venv_python(tmp_path / "p")


def test_a_python_the_bundle_does_not_serve_is_refused_naming_the_versions_it_does(tmp_path, tmp_path_factory):
    # A python3 that reports CPython 3.10 when the installer asks what it is, and is the real one otherwise.
    fake = tmp_path / "python3"
    report = ('import json, platform; print(json.dumps({"machine": platform.machine(), "python": "3.10", '
              '"libc": platform.libc_ver()}))')
    fake.write_text(f"""#!/bin/sh
case "$*" in
  *platform.libc_ver*) exec {bundle_kit.BASE_PYTHON} -c '{report}' ;;
esac
exec {bundle_kit.BASE_PYTHON} "$@"
""")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    tar, pub = bundle_kit.bundle(tmp_path_factory), bundle_kit.public_key(tmp_path_factory)
    proc = bundle_kit.install(tar, tmp_path / "p", pubkey=pub, python=fake)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"refused: {fake}: CPython 3.10 on x86_64; profile test of {tar.name} serves CPython 3.11, 3.12 on "
        "x86_64-manylinux_2_28 (pass --python PATH to one of those); the bundle holds "
        "test (x86_64-manylinux_2_28, CPython 3.11/3.12)")
    assert not (tmp_path / "p" / "releases").exists()


SERVED = ("3.11", "3.12")  # the test profile's pythons (manifests/profiles.toml)


def other_served_python() -> tuple[str, str] | tuple[None, str]:
    """(version, path) of a CPython the test profile serves other than the tests' own, found where a box
    keeps one (PATH, pyenv, uv); else (None, why not). CI never downloads one: the run's summary says
    when this test skipped (tests/conftest.py)."""
    here = "%d.%d" % sys.version_info[:2]
    for version in (v for v in SERVED if v != here):
        found = [shutil.which(f"python{version}")]
        for root in ("~/.pyenv/versions", "/root/.pyenv/versions", "~/.local/share/uv/python"):
            found += sorted(glob.glob(os.path.join(os.path.expanduser(root), f"*{version}.*", "bin", f"python{version}")))
        for path in filter(None, found):
            probe = subprocess.run([path, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip() == version:
                return version, path
    others = " or ".join(f"CPython {v}" for v in SERVED if v != here)
    return None, f"no {others} on this host (PATH, pyenv, uv); the bootstrap installs none"


def test_a_real_second_interpreter_gets_the_other_lock(tmp_path, tmp_path_factory):
    version, python = other_served_python()
    if version is None:
        pytest.skip(python)
    tar, pub = bundle_kit.bundle(tmp_path_factory), bundle_kit.public_key(tmp_path_factory)
    proc = bundle_kit.install(tar, tmp_path / "p", pubkey=pub, python=python)
    assert proc.returncode == 0, proc.stderr
    assert installed_lock_python(tmp_path / "p") == version == venv_python(tmp_path / "p")
    record = json.loads((tmp_path / "p" / "current" / "install.json").read_text())
    assert record["python"] == python
    assert bundle_kit.installed(tmp_path / "p", "--version").stdout.strip() == "appliance 0.1.0"
