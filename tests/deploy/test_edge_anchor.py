"""The device's trust anchor (`appliance edge anchor`), run as on a device: its install-package and
bin/verify (aarch64, under qemu-aarch64 with Debian arm64 libc) install a package only after its
signature (the anchor's own key), sums and file list are checked. A tampered package never runs a byte:
its install.sh, or its bin/run (which the self-test would run), is made to create a marker file, and the
marker must not exist after the anchor refused it. Also: the refusal line of a first install checked
by stock minisign says what failed (it ended in an empty "minisign: ")."""

import os
import shutil
import subprocess
import tarfile

import pytest

from appliance.core import minisign
from appliance.core.manifest import sha256_file
from deploy.test_edge_install import (device_sysroot, install, installed_files, package, resign, resum,  # noqa: F401
                                      run_sh, site_pub)

MARKER_LINE = "touch {marker}\n"


@pytest.fixture(scope="module")
def anchor(tmp_path_factory, edge_package):
    """The anchor made with the site key (the one the session's package is signed with), as a device holds it."""
    from appliance.deploy.edge.anchor import build_anchor

    work = tmp_path_factory.mktemp("anchor")
    info = build_anchor(work / "edge-anchor.tar")
    with tarfile.open(work / "edge-anchor.tar") as tar:
        tar.extractall(work / "device" / "opt", filter="data")
    root = work / "device" / "opt" / "edge-anchor"
    return root, info


@pytest.fixture(scope="module")
def other_key(tmp_path_factory):
    work = tmp_path_factory.mktemp("attacker-key")
    pub, key, key_id = minisign.generate_key_pair("attacker")
    (work / "attacker.key").write_text(key)
    (work / "attacker.pub").write_text(pub)
    return work / "attacker.key", key_id


def through_anchor(anchor_root, package, prefix, sysroot, *extra):
    return run_sh(anchor_root / "install-package", ["--package", package, "--prefix", prefix, *extra], sysroot)


def test_the_anchor_is_signed_and_checks_with_stock_minisign(anchor, site_pub):
    root, info = anchor
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == [
        "SHA256SUMS", "SHA256SUMS.minisig", "bin/verify", "install-package", "trusted.pub"]
    assert (root / "trusted.pub").read_bytes() == site_pub.read_bytes()
    assert minisign.verify_file(str(root / "SHA256SUMS"), str(root / "SHA256SUMS.minisig"), str(site_pub))
    if shutil.which("minisign"):
        subprocess.run(["minisign", "-Vm", str(root / "SHA256SUMS"), "-p", str(site_pub)], check=True,
                       capture_output=True)
    subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=root, check=True)


def test_a_genuine_package_installs_through_the_anchor(anchor, package, device_sysroot, site_pub, tmp_path):
    root, _ = anchor
    prefix = tmp_path / "opt" / "appliance-edge"
    proc = through_anchor(root, package, prefix, device_sysroot)
    assert proc.returncode == 0, proc.stderr
    assert "selftest PASS" in proc.stdout
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith(f"installed in {prefix} (SHA256SUMS ") and f"with {root}/install-package --package" in last
    assert (prefix / ".appliance-edge" / "trusted.pub").read_bytes() == site_pub.read_bytes()
    assert (prefix / "model.so").read_bytes() == (package / "model.so").read_bytes()


def plant(package, name, marker):
    """name made to create marker when it runs (a shell script: the device runs both install.sh and bin/run)."""
    path = package / name
    if name == "install.sh":
        text = path.read_text()
        path.write_text(text.replace("set -eu\n", "set -eu\n" + MARKER_LINE.format(marker=marker), 1))
    else:
        path.write_text("#!/bin/sh\n" + MARKER_LINE.format(marker=marker))
    path.chmod(0o755)


@pytest.mark.parametrize("case", ["install.sh, sums not updated", "install.sh re-summed, not re-signed",
                                  "install.sh re-signed with another key", "bin/run re-signed with another key",
                                  "model.so re-summed, not re-signed"])
def test_a_tampered_package_never_runs_through_the_anchor(anchor, package, device_sysroot, other_key, tmp_path, case):
    root, info = anchor
    marker = tmp_path / "ran"
    name = case.split(" ", 1)[0].rstrip(",")
    if name == "model.so":
        data = bytearray((package / "model.so").read_bytes())
        data[len(data) // 2] ^= 0xFF  # a flipped byte in the middle of the model's code or weights
        (package / "model.so").write_bytes(bytes(data))
    else:
        plant(package, name, marker)
    if "re-summed" in case:
        resum(package)
    if "another key" in case:
        resign(package, other_key[0])
    prefix = tmp_path / "opt" / "appliance-edge"
    proc = through_anchor(root, package, prefix, device_sysroot)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr
    if "not updated" in case:
        expected = f"install.sh: error: {package}/{name}: sha256 does not match SHA256SUMS"
    elif "another key" in case:
        expected = (f"install.sh: error: {package}/SHA256SUMS.minisig: signed by key {other_key[1]}, not by the "
                    f"trusted key {info['key_id']}")
    else:
        expected = (f"install.sh: error: {package}/SHA256SUMS.minisig: signature does not match SHA256SUMS "
                    "(changed after signing, or not signed with the trusted key); nothing installed")
    assert lines[0].startswith(expected), lines[0]
    assert not marker.exists(), f"{case}: the package's {name} ran"
    assert not [p for p in prefix.rglob("*") if p.is_file()]
    # What the anchor prevents: the same package's own install.sh, run by hand, runs its first lines.
    if name == "install.sh":
        run_sh(package / "install.sh", ["--prefix", tmp_path / "by-hand", "--pubkey", root / "trusted.pub"],
               device_sysroot)
        assert marker.exists()


def test_the_anchor_trusts_only_its_own_key(anchor, package, device_sysroot, other_key, tmp_path):
    root, _ = anchor
    (tmp_path / "attacker.pub").write_text(other_key[0].with_suffix(".pub").read_text())
    for extra, said in ((["--pubkey", tmp_path / "attacker.pub"], "not the key this trust anchor holds"),
                        (["--trust-package-key"], "the trust anchor trusts only its own key")):
        proc = through_anchor(root, package, tmp_path / "p", device_sysroot, *extra)
        assert proc.returncode == 1 and said in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    proc = run_sh(root / "install-package", ["--prefix", tmp_path / "p"], device_sysroot)
    assert proc.returncode == 1 and "--package DIR: the package to install is needed" in proc.stderr
    assert not installed_files(tmp_path / "p") if (tmp_path / "p").exists() else True


@pytest.mark.skipif(shutil.which("minisign") is None, reason="stock minisign is not installed")
def test_a_refusal_by_stock_minisign_says_what_failed(package, device_sysroot, site_pub, other_key, tmp_path):
    """A first install with the package's own install.sh checks with the system's minisign; its refusal
    ended in an empty "(minisign: )" because minisign -q says nothing."""
    resign(package, other_key[0])
    proc = install(package, tmp_path / "p", device_sysroot, site_pub)
    line = proc.stderr.strip()
    assert proc.returncode == 1 and len(line.splitlines()) == 1, proc.stderr
    prefix = f"install.sh: error: {package}/SHA256SUMS.minisig: signature check failed (minisign: "
    assert line.startswith(prefix) and line.endswith("); nothing installed"), line
    detail = line[len(prefix):-len("); nothing installed")]
    assert "key id" in detail.lower() or "signature" in detail.lower(), detail
    assert sha256_file(package / "SHA256SUMS") and not os.path.exists(tmp_path / "p" / "bin")
