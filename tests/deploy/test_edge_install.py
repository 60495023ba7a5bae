"""The edge package's install.sh, run as on a device: the aarch64 programs under qemu-aarch64 with
Debian arm64 system libraries (libc6, libstdc++6, libgcc-s1 from the bundle's .debs), no network."""

import os
import shutil
import subprocess
import tarfile

import pytest

from conftest import offline_cmd
from appliance.core.manifest import sha256_file

DEVICE_LIBS = ("libc6_", "libstdc++6_", "libgcc-s1_")


@pytest.fixture(scope="module")
def device_sysroot(tmp_path_factory):
    from appliance.deploy.edge.sysroot import default_debs_dir

    debs = default_debs_dir()
    if not (debs / "manifest.json").is_file():
        pytest.fail(f"{debs}: no arm64 .debs (run `installer/bootstrap.sh --edge-sysroot` on a connected host)")
    root = tmp_path_factory.mktemp("arm64-sysroot")
    for prefix in DEVICE_LIBS:
        [deb] = [d for d in debs.glob("*.deb") if d.name.startswith(prefix)]
        subprocess.run(["dpkg", "-x", str(deb), str(root)], check=True)
    return root


@pytest.fixture
def package(tmp_path, edge_package):
    """A fresh unpacked copy of the edge package, as a site would carry it onto the device."""
    with tarfile.open(edge_package) as tar:
        tar.extractall(tmp_path / "media", filter="data")
    return tmp_path / "media" / "edge-package"


def install(package, prefix, sysroot, path_dirs=(), env=None):
    env = {**os.environ, "EDGE_EMULATOR": f"qemu-aarch64 -L {sysroot}", **(env or {})}
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), env["PATH"]])
    return subprocess.run(offline_cmd(["sh", str(package / "install.sh"), "--prefix", str(prefix)]),
                          capture_output=True, text=True, env=env, timeout=600)


def installed_files(prefix):
    return {str(p.relative_to(prefix)): sha256_file(p) for p in prefix.rglob("*") if p.is_file()}


def test_install_runs_the_selftest_and_a_second_run_changes_nothing(package, device_sysroot, tmp_path):
    prefix = tmp_path / "opt" / "appliance-edge"
    proc = install(package, prefix, device_sysroot)
    assert proc.returncode == 0, proc.stderr
    assert "selftest PASS: 8 golden samples" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith(f"installed in {prefix} (SHA256SUMS ")
    files = installed_files(prefix)
    assert {name: digest for name, digest in files.items() if name != ".installed"} == installed_files(package)
    assert (prefix / ".installed").read_text().strip() == sha256_file(package / "SHA256SUMS")
    assert os.access(prefix / "bin" / "run", os.X_OK) and (prefix / "model.so").stat().st_mode & 0o044 == 0o044
    assert not list(prefix.glob(".install.*"))  # the private staging copy is gone
    inode = (prefix / "model.so").stat().st_ino

    again = install(package, prefix, device_sysroot)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines() == [
        f"install.sh: {prefix} already holds this package (SHA256SUMS {sha256_file(package / 'SHA256SUMS')}); "
        "nothing changed"]
    assert (prefix / "model.so").stat().st_ino == inode and installed_files(prefix) == files


def test_a_tampered_file_is_refused_and_nothing_installed(package, device_sysroot, tmp_path):
    info = package / "model.json"
    info.write_text(info.read_text().replace("south-east", "south-EAST"))
    prefix = tmp_path / "prefix"
    proc = install(package, prefix, device_sysroot)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/model.json: sha256 does not match SHA256SUMS (damaged or modified after "
        "packaging); nothing installed"]
    assert installed_files(prefix) == {} and not list(prefix.glob(".install.*"))


def test_an_unlisted_file_or_a_link_is_refused(package, device_sysroot, tmp_path):
    (package / "lib" / "libextra.so").write_bytes(b"\x7fELF planted")
    proc = install(package, tmp_path / "p1", device_sysroot)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/lib/libextra.so: not listed in SHA256SUMS (added after packaging); "
        "nothing installed"]
    (package / "lib" / "libextra.so").unlink()
    (package / "lib" / "libtvm_ffi.so").rename(tmp_path / "libtvm_ffi.so")
    (package / "lib" / "libtvm_ffi.so").symlink_to(tmp_path / "libtvm_ffi.so")
    proc = install(package, tmp_path / "p2", device_sysroot)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/lib/libtvm_ffi.so: not a regular file (links and devices are refused)"]
    assert installed_files(tmp_path / "p2") == {}


def test_a_file_swapped_after_the_check_is_never_installed(package, device_sysroot, tmp_path):
    """The checksum step itself swaps model.so on the carried media right after it succeeds: the
    installer must install the bytes it checked (its private copy), not the swapped file."""
    shims = tmp_path / "shims"
    shims.mkdir()
    real = shutil.which("sha256sum")
    (shims / "sha256sum").write_text(
        "#!/bin/sh\n"
        f"{real} \"$@\"; rc=$?\n"
        "if [ ! -e \"$SWAP_DONE\" ]; then cp \"$SWAP_WITH\" \"$SWAP_TARGET\"; touch \"$SWAP_DONE\"; fi\n"
        "exit $rc\n")
    (shims / "sha256sum").chmod(0o755)
    evil = tmp_path / "evil.so"
    evil.write_bytes(b"\x7fELF not the model that was checked")
    original = sha256_file(package / "model.so")
    prefix = tmp_path / "prefix"
    proc = install(package, prefix, device_sysroot, path_dirs=[shims],
                   env={"SWAP_WITH": str(evil), "SWAP_TARGET": str(package / "model.so"),
                        "SWAP_DONE": str(tmp_path / "swapped")})
    assert (tmp_path / "swapped").exists() and sha256_file(package / "model.so") == sha256_file(evil)
    assert proc.returncode == 0, proc.stderr
    assert sha256_file(prefix / "model.so") == original and "selftest PASS" in proc.stdout


def test_a_failing_selftest_fails_the_install_and_leaves_no_install_mark(package, device_sysroot, tmp_path):
    """Golden outputs this model does not reproduce, re-summed so that every checksum passes."""
    import hashlib

    import numpy as np

    expected = np.load(package / "selftest/expected.npy")
    np.save(package / "selftest/expected.npy", expected[::-1].copy())
    (package / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(package)}\n"
        for p in sorted(package.rglob("*")) if p.is_file() and p.name != "SHA256SUMS"))
    prefix = tmp_path / "prefix"
    for _ in range(2):  # and the second run is not taken for an installed package
        proc = install(package, prefix, device_sysroot)
        assert proc.returncode == 1
        assert "selftest FAIL: 8 golden samples" in proc.stdout
        assert proc.stderr.strip().splitlines() == [
            f"install.sh: error: {prefix}/bin/run --selftest failed: the installed model does not reproduce the "
            "host's outputs on this device"]
        assert not (prefix / ".installed").exists()
