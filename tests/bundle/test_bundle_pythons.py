"""A bundle serving CPython 3.11 and 3.12: the installer takes the lock of the interpreter it finds."""

import glob
import json
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


def test_a_real_second_interpreter_gets_the_other_lock(tmp_path, tmp_path_factory):
    found = sorted(glob.glob("/root/.pyenv/versions/3.12.*/bin/python3.12"))
    if not found:
        pytest.skip("no CPython 3.12 on this host (pyenv)")
    tar, pub = bundle_kit.bundle(tmp_path_factory), bundle_kit.public_key(tmp_path_factory)
    proc = bundle_kit.install(tar, tmp_path / "p", pubkey=pub, python=found[-1])
    assert proc.returncode == 0, proc.stderr
    assert installed_lock_python(tmp_path / "p") == "3.12" == venv_python(tmp_path / "p")
    record = json.loads((tmp_path / "p" / "current" / "install.json").read_text())
    assert record["python"] == found[-1]
    assert bundle_kit.installed(tmp_path / "p", "--version").stdout.strip() == "appliance 0.1.0"
