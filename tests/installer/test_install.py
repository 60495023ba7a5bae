"""installer/install.sh: offline install of a real bundle, self-test, no-op re-run, upgrade and rollback."""

import json
import os
import sys

import pytest

import bundle_kit
from conftest import ROOT

sys.path.insert(0, str(ROOT / "installer"))
import install_bundle  # noqa: E402


@pytest.mark.parametrize("use", ["uv", "pip"])
def test_offline_install_then_the_installed_appliance_runs(tmp_path, tmp_path_factory, use):
    """uv when the bundle carries its wheel; pip when it does not (the fallback)."""
    tar = bundle_kit.bundle(tmp_path_factory, without_uv=use == "pip")
    prefix = tmp_path / "opt-appliance"
    proc = bundle_kit.install(tar, prefix, pubkey=bundle_kit.public_key(tmp_path_factory))
    assert proc.returncode == 0, proc.stderr
    assert "signature: verified" in proc.stderr and f"with {use}, offline" in proc.stderr

    release = os.readlink(prefix / "current")
    assert release.startswith("releases/0.1.0-")
    record = json.loads((prefix / "current" / "install.json").read_text())
    assert record["installer"] == use and record["profile"] == "test" and record["version"] == "0.1.0"
    assert "appliance doctor --json: valid report" in record["self_test"][-1]
    saved = json.loads((prefix / "current" / "doctor.json").read_text())  # the install's doctor report
    assert saved["python"]["executable"] == str(prefix.resolve() / release / "venv" / "bin" / "python")

    # The installed command, offline, from a shell with no PYTHONPATH: it is the venv's own copy.
    help_ = bundle_kit.installed(prefix, "--help")
    assert help_.returncode == 0 and "doctor" in help_.stdout and "bundle" in help_.stdout
    version = bundle_kit.installed(prefix, "--version")
    assert version.stdout.strip() == "appliance 0.1.0"
    doctor = bundle_kit.installed(prefix, "doctor", "--json")
    assert doctor.returncode == 1  # problems: the test profile deliberately lacks torch
    report = json.loads(doctor.stdout)
    assert report["network"]["state"] == "none"
    assert any(p.startswith("torch is not usable") for p in report["problems"])
    assert report["python"]["executable"].startswith(str(prefix / "releases"))
    # Nothing left behind but the release and the links.
    assert sorted(p.name for p in prefix.iterdir()) == [".install.lock", "current", "logs", "releases"]


def test_reinstalling_the_same_bundle_is_a_no_op(tmp_path, tmp_path_factory):
    tar, pub = bundle_kit.bundle(tmp_path_factory), bundle_kit.public_key(tmp_path_factory)
    prefix = tmp_path / "p"
    assert bundle_kit.install(tar, prefix, pubkey=pub).returncode == 0
    before = bundle_kit.state(prefix)
    venv_mtime = (prefix / "current" / "venv").stat().st_mtime_ns
    proc = bundle_kit.install(tar, prefix, pubkey=pub)
    assert proc.returncode == 0, proc.stderr
    assert "is already installed and current" in proc.stderr and "nothing to do" in proc.stderr
    assert bundle_kit.state(prefix) == before
    assert (prefix / "current" / "venv").stat().st_mtime_ns == venv_mtime


def test_upgrade_then_rollback_then_forward_again(tmp_path, tmp_path_factory):
    pub = bundle_kit.public_key(tmp_path_factory)
    old, new = bundle_kit.bundle(tmp_path_factory, "0.1.0"), bundle_kit.bundle(tmp_path_factory, "0.1.1")
    prefix = tmp_path / "p"
    assert bundle_kit.install(old, prefix, pubkey=pub).returncode == 0
    old_release = os.readlink(prefix / "current")

    proc = bundle_kit.install(new, prefix, pubkey=pub)
    assert proc.returncode == 0, proc.stderr
    new_release = os.readlink(prefix / "current")
    assert new_release.startswith("releases/0.1.1-") and os.readlink(prefix / "previous") == old_release
    assert bundle_kit.installed(prefix, "--version").stdout.strip() == "appliance 0.1.1"

    proc = bundle_kit.install(old, prefix, "--rollback")  # BUNDLE is ignored with --rollback
    assert proc.returncode == 0, proc.stderr
    assert os.readlink(prefix / "current") == old_release and os.readlink(prefix / "previous") == new_release
    assert bundle_kit.installed(prefix, "--version").stdout.strip() == "appliance 0.1.0"
    assert "rolled back" in proc.stderr

    # Installing 0.1.1 again reuses its complete release instead of rebuilding it.
    proc = bundle_kit.install(new, prefix, pubkey=pub)
    assert proc.returncode == 0 and "switching to it" in proc.stderr
    assert bundle_kit.installed(prefix, "--version").stdout.strip() == "appliance 0.1.1"


def test_failed_self_test_keeps_the_previous_install_current(tmp_path, tmp_path_factory):
    pub = bundle_kit.public_key(tmp_path_factory)
    good, broken = bundle_kit.bundle(tmp_path_factory), bundle_kit.bundle(tmp_path_factory, "0.2.0", broken=True)
    prefix = tmp_path / "p"
    assert bundle_kit.install(good, prefix, pubkey=pub).returncode == 0
    before = bundle_kit.state(prefix)
    proc = bundle_kit.install(broken, prefix, pubkey=pub)
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("refused: self-test `appliance --help`: exit status 1: ImportError: deliberately broken build")
    log = line.rsplit("(full output: ", 1)[1].rstrip(")")
    assert "deliberately broken build" in open(log).read()  # the evidence outlives the removed release
    after = bundle_kit.state(prefix)
    assert after["links"] == before["links"] and after["records"] == before["records"]
    assert set(after["entries"]) - set(before["entries"]) <= {"logs"}
    assert bundle_kit.installed(prefix, "--version").stdout.strip() == "appliance 0.1.0"


def test_rollback_without_a_previous_install_is_refused(tmp_path):
    proc = bundle_kit.install(tmp_path / "none.tar", tmp_path / "p", "--rollback")
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"refused: {tmp_path / 'p'}: no previous install to roll back to"


def test_downgrade_is_refused_naming_both_versions_then_allowed_with_the_flag(tmp_path, tmp_path_factory):
    pub = bundle_kit.public_key(tmp_path_factory)
    old, new = bundle_kit.bundle(tmp_path_factory, "0.1.0"), bundle_kit.bundle(tmp_path_factory, "0.1.1")
    prefix = tmp_path / "p"
    assert bundle_kit.install(new, prefix, pubkey=pub).returncode == 0
    release = os.readlink(prefix / "current")
    before = bundle_kit.state(prefix)
    proc = bundle_kit.install(old, prefix, pubkey=pub)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1] == (
        f"refused: {old}: version 0.1.0 is older than the installed 0.1.1 ({prefix / 'current'} -> {release}); "
        "pass --allow-downgrade to install it anyway, or --rollback to return to the previous install")
    assert bundle_kit.state(prefix) == before

    proc = bundle_kit.install(old, prefix, "--allow-downgrade", pubkey=pub)
    assert proc.returncode == 0, proc.stderr
    assert bundle_kit.installed(prefix, "--version").stdout.strip() == "appliance 0.1.0"
    assert os.readlink(prefix / "previous") == release


@pytest.mark.parametrize("lower, higher", [("0.1.0", "0.1.1"), ("0.9.9", "0.10.0"), ("1.0rc1", "1.0"),
                                           ("1.0.dev1", "1.0a1"), ("1.0", "1.0.post1"), ("1.0a2", "1.0b1"),
                                           ("1.0.post1.dev1", "1.0.post1")])
def test_version_order(lower, higher):
    assert install_bundle.version_key(lower) < install_bundle.version_key(higher)
    assert install_bundle.version_key("0.2") == install_bundle.version_key("0.2.0")
    assert install_bundle.version_key("not a version") is None
