"""The edge package's install.sh, run as on a device: the aarch64 programs under qemu-aarch64 with
Debian arm64 system libraries (libc6, libstdc++6, libgcc-s1 from the bundle's .debs), no network.

Trust: the first install takes the site's public key (--pubkey); every later package is checked by
the ALREADY-INSTALLED install.sh and bin/run (--verify-signature) before any file of it runs.
Ownership: install.sh replaces only the files its list (PREFIX/.appliance-edge/files) names."""

import hashlib
import os
import shutil
import subprocess
import tarfile

import pytest

from conftest import offline_cmd
from appliance.core import minisign
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


def unpack(edge_package, into):
    with tarfile.open(edge_package) as tar:
        tar.extractall(into, filter="data")
    return into / "edge-package"


@pytest.fixture
def package(tmp_path, edge_package):
    """A fresh unpacked copy of the edge package, as a site would carry it onto the device."""
    return unpack(edge_package, tmp_path / "media")


@pytest.fixture(scope="module")
def site_pub(edge_package):
    from appliance.deploy.edge.signing import default_key_path, public_path

    return public_path(default_key_path())


def run_sh(script, args, sysroot, path_dirs=(), env=None):
    env = {**os.environ, "EDGE_EMULATOR": f"qemu-aarch64 -L {sysroot}", **(env or {})}
    env["PATH"] = os.pathsep.join([*map(str, path_dirs), env["PATH"]])
    return subprocess.run(offline_cmd(["sh", str(script), *map(str, args)]), capture_output=True, text=True,
                          env=env, timeout=600)


def install(package, prefix, sysroot, pubkey, *extra, **kw):
    return run_sh(package / "install.sh", ["--prefix", prefix, *(["--pubkey", pubkey] if pubkey else []), *extra],
                  sysroot, **kw)


def upgrade(prefix, package, sysroot, **kw):
    """What a site runs for every later package: the installed copy of install.sh."""
    return run_sh(prefix / "install.sh", ["--package", package], sysroot, **kw)


def installed_files(prefix):
    return {str(p.relative_to(prefix)): sha256_file(p) for p in prefix.rglob("*") if p.is_file()}


def resum(package):
    """What someone without the key can do: rewrite SHA256SUMS to match the changed files."""
    (package / "SHA256SUMS").write_text("".join(
        f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(package)}\n"
        for p in sorted(package.rglob("*")) if p.is_file() and p.name not in ("SHA256SUMS", "SHA256SUMS.minisig")))


def resign(package, key=None):
    """What the site can do: re-sum and sign with its key (or with another key)."""
    resum(package)
    key = key or os.environ["APPLIANCE_EDGE_KEY"]
    (package / "SHA256SUMS.minisig").write_text(minisign.sign_file(str(package / "SHA256SUMS"), str(key), "test"))


def test_install_runs_the_selftest_and_a_second_run_changes_nothing(package, device_sysroot, site_pub, tmp_path):
    prefix = tmp_path / "opt" / "appliance-edge"
    proc = install(package, prefix, device_sysroot, site_pub)
    assert proc.returncode == 0, proc.stderr
    assert "selftest PASS: 8 golden samples" in proc.stdout
    assert proc.stdout.strip().splitlines()[-1].startswith(f"installed in {prefix} (SHA256SUMS ")
    files = installed_files(prefix)
    state = {".appliance-edge/files", ".appliance-edge/installed", ".appliance-edge/trusted.pub"}
    assert {n: d for n, d in files.items() if n not in state} == installed_files(package)
    listed = (prefix / ".appliance-edge" / "files").read_text().split()
    assert sorted(listed) == sorted(installed_files(package))  # exactly what it put there
    assert (prefix / ".appliance-edge" / "installed").read_text().strip() == sha256_file(package / "SHA256SUMS")
    assert (prefix / ".appliance-edge" / "trusted.pub").read_bytes() == site_pub.read_bytes()
    assert os.access(prefix / "bin" / "run", os.X_OK) and (prefix / "model.so").stat().st_mode & 0o044 == 0o044
    assert (prefix / "bin").stat().st_mode & 0o055 == 0o055  # services can reach the model
    assert not list(prefix.glob(".install.*"))  # the private staging copy is gone
    inode = (prefix / "model.so").stat().st_ino

    again = upgrade(prefix, package, device_sysroot)
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip().splitlines() == [
        f"install.sh: {prefix} already holds this package (SHA256SUMS {sha256_file(package / 'SHA256SUMS')}); "
        "nothing changed"]
    assert (prefix / "model.so").stat().st_ino == inode and installed_files(prefix) == files


def test_a_first_install_needs_the_site_key(package, device_sysroot, site_pub, tmp_path):
    proc = install(package, tmp_path / "p1", device_sysroot, None)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {tmp_path / 'p1'}: no trusted key yet: pass --pubkey KEY.pub (the site's public key, "
        "carried to this device once), or --trust-package-key"]
    other, _, other_id = minisign.generate_key_pair("not the site")
    (tmp_path / "other.pub").write_text(other)
    for path in (None, hide_minisign(tmp_path)):  # the system's minisign, then the package's bin/run
        proc = install(package, tmp_path / "p2", device_sysroot, tmp_path / "other.pub",
                       env={"PATH": str(path)} if path else None)
        assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"install.sh: error: {package}/SHA256SUMS.minisig: ")
        assert not installed_files(tmp_path / "p2")
    assert f"not by the trusted key {other_id}" in proc.stderr
    tofu = install(package, tmp_path / "p3", device_sysroot, None, "--trust-package-key")
    assert tofu.returncode == 0, tofu.stderr
    assert "trusting on first use the key the package carries: minisign public key" in tofu.stdout
    assert (tmp_path / "p3" / ".appliance-edge" / "trusted.pub").read_bytes() == site_pub.read_bytes()


def hide_minisign(tmp_path):
    """A PATH of one folder, without `minisign`: install.sh then checks with the package's bin/run."""
    shims = tmp_path / "no-minisign"
    shims.mkdir(exist_ok=True)
    for tool in ("sh", "sha256sum", "find", "sed", "grep", "sort", "comm", "cut", "cp", "mv", "rm", "mkdir",
                 "mktemp", "chmod", "cat", "head", "tail", "tr", "wc", "dirname", "cmp", "qemu-aarch64", "unshare"):
        if not (shims / tool).exists() and shutil.which(tool):
            (shims / tool).symlink_to(shutil.which(tool))
    return shims


@pytest.fixture(scope="module")
def trusted_install(tmp_path_factory, edge_package, device_sysroot, site_pub):
    """A device that installed the genuine package once (its key and bin/run are what it trusts)."""
    base = tmp_path_factory.mktemp("device")
    prefix = base / "opt" / "appliance-edge"
    proc = install(unpack(edge_package, base / "first"), prefix, device_sysroot, site_pub)
    assert proc.returncode == 0, proc.stderr
    return prefix


def plant(package, name, marker):
    path = package / name
    if name == "install.sh":  # code an attacker wants run as root
        path.write_text(path.read_text().replace("set -eu\n", f"set -eu\ntouch {marker}\n", 1))
    elif name == "model.json":
        path.write_text(path.read_text().replace("south-east", "south-EAST"))
    else:  # model.so, bin/run: other bytes
        path.write_bytes(path.read_bytes() + b"\x00planted")


@pytest.mark.parametrize("name", ["install.sh", "model.so", "bin/run", "model.json"])
def test_a_tampered_resummed_package_is_refused_by_the_installed_runner(name, package, trusted_install,
                                                                       device_sysroot, tmp_path):
    before = installed_files(trusted_install)
    marker = tmp_path / "planted-code-ran"
    plant(package, name, marker)
    resum(package)
    assert subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=package).returncode == 0
    proc = upgrade(trusted_install, package, device_sysroot)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/SHA256SUMS.minisig: signature does not match SHA256SUMS (changed after "
        "signing, or not signed with the trusted key); nothing installed"]
    assert not marker.exists() and installed_files(trusted_install) == before


def test_an_unsigned_or_foreign_signed_package_is_refused(package, trusted_install, device_sysroot, tmp_path):
    before = installed_files(trusted_install)
    pub_text, key_text, other_id = minisign.generate_key_pair("attacker")
    (tmp_path / "attacker.key").write_text(key_text)
    plant(package, "model.so", tmp_path / "unused")
    (package / "signing-key.pub").write_text(pub_text)  # the package's own copy is never what is trusted
    resign(package, tmp_path / "attacker.key")
    trusted_id = minisign.key_id_text(minisign.read_public_key(str(trusted_install / ".appliance-edge/trusted.pub"))[0])
    proc = upgrade(trusted_install, package, device_sysroot)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/SHA256SUMS.minisig: signed by key {other_id}, not by the trusted key "
        f"{trusted_id} ({trusted_install}/.appliance-edge/trusted.pub); nothing installed"]
    (package / "SHA256SUMS.minisig").unlink()
    proc = upgrade(trusted_install, package, device_sysroot)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/SHA256SUMS.minisig: missing: the package is not signed (made by an "
        "`appliance package` without signing?); nothing installed"]
    assert installed_files(trusted_install) == before


def test_an_upgrade_replaces_exactly_its_own_files(package, device_sysroot, site_pub, tmp_path, edge_package):
    prefix = tmp_path / "prefix"
    assert install(package, prefix, device_sysroot, site_pub).returncode == 0
    # The site's own files, beside and among ours.
    (prefix / "etc").mkdir()
    (prefix / "etc" / "service.conf").write_text("threads = 2\n")
    (prefix / "bin" / "site-tool").write_text("#!/bin/sh\necho site\n")
    (prefix / "lib" / "libsite.so").write_bytes(b"site library")
    # A next package: reference/model.onnx gone, a notes file new, model.json changed; signed by the site.
    new = unpack(edge_package, tmp_path / "v2")
    (new / "reference" / "model.onnx").unlink()
    (new / "NOTES.txt").write_text("v2\n")
    (new / "model.json").write_text((new / "model.json").read_text().replace("south-east", "south-east (v2)"))
    resign(new)
    proc = upgrade(prefix, new, device_sysroot)
    assert proc.returncode == 0, proc.stderr
    files = installed_files(prefix)
    assert files["etc/service.conf"] == sha256_file(tmp_path / "prefix/etc/service.conf")
    assert {"bin/site-tool", "lib/libsite.so", "NOTES.txt"} <= set(files)
    assert "reference/model.onnx" not in files  # the old package's file, which the new one lacks
    assert "south-east (v2)" in (prefix / "model.json").read_text()
    assert sorted((prefix / ".appliance-edge" / "files").read_text().split()) == sorted(installed_files(new))
    # A new package file where the site has its own file: refused, nothing changed.
    newer = unpack(edge_package, tmp_path / "v3")
    (newer / "bin" / "site-tool").write_text("#!/bin/sh\necho ours\n")
    resign(newer)
    before = installed_files(prefix)
    proc = upgrade(prefix, newer, device_sysroot)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {prefix}/bin/site-tool: exists and was not installed by this installer (not in "
        f"{prefix}/.appliance-edge/files); nothing installed"]
    assert installed_files(prefix) == before


@pytest.mark.parametrize("layout", ["usr-local", "home"])
def test_a_prefix_holding_foreign_files_is_refused_and_left_alone(layout, package, device_sysroot, site_pub,
                                                                  tmp_path):
    prefix = tmp_path / layout
    for name in ("bin/python-tool", "lib/libfoo.so.1", "share/man/man1/tool.1") if layout == "usr-local" else (
            ".bashrc", "bin/notes.sh", "lib/x"):
        (prefix / name).parent.mkdir(parents=True, exist_ok=True)
        (prefix / name).write_text(name)
    (prefix / "lib" / "libfoo.so").symlink_to("libfoo.so.1" if layout == "usr-local" else "x")
    before = installed_files(prefix)
    proc = install(package, prefix, device_sysroot, site_pub)
    assert proc.returncode == 1
    [line] = proc.stderr.strip().splitlines()
    assert line.startswith(f"install.sh: error: {prefix}: holds 4 file(s) this installer did not put there ("
                           f"{prefix}/") and line.endswith(f"and no {prefix}/.appliance-edge/files: nothing installed; "
                                                           "install into an empty or new directory")
    assert installed_files(prefix) == before and not list(prefix.glob(".install.*"))
    assert not (prefix / ".appliance-edge").exists()


def test_a_usr_local_like_prefix_of_empty_folders_is_used_and_kept(package, device_sysroot, site_pub, tmp_path):
    prefix = tmp_path / "usr-local"
    for folder in ("bin", "etc", "include", "lib", "sbin", "share/man", "src"):
        (prefix / folder).mkdir(parents=True)
    proc = install(package, prefix, device_sysroot, site_pub)
    assert proc.returncode == 0, proc.stderr
    assert all((prefix / folder).is_dir() for folder in ("etc", "include", "sbin", "share/man", "src"))


def test_a_tampered_file_is_refused_and_nothing_installed(package, device_sysroot, site_pub, tmp_path):
    info = package / "model.json"
    info.write_text(info.read_text().replace("south-east", "south-EAST"))
    resign(package)  # even the site's signature does not let a file differ from its sum
    (package / "model.json").write_text(info.read_text().replace("south-EAST", "south-WEST"))
    prefix = tmp_path / "prefix"
    proc = install(package, prefix, device_sysroot, site_pub)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/model.json: sha256 does not match SHA256SUMS (damaged or modified after "
        "packaging); nothing installed"]
    assert installed_files(prefix) == {} and not list(prefix.glob(".install.*"))


def test_an_unlisted_file_or_a_link_is_refused(package, device_sysroot, site_pub, tmp_path):
    (package / "lib" / "libextra.so").write_bytes(b"\x7fELF planted")
    proc = install(package, tmp_path / "p1", device_sysroot, site_pub)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/lib/libextra.so: not listed in SHA256SUMS (added after packaging); "
        "nothing installed"]
    (package / "lib" / "libextra.so").unlink()
    (package / "lib" / "libtvm_ffi.so").rename(tmp_path / "libtvm_ffi.so")
    (package / "lib" / "libtvm_ffi.so").symlink_to(tmp_path / "libtvm_ffi.so")
    proc = install(package, tmp_path / "p2", device_sysroot, site_pub)
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"install.sh: error: {package}/lib/libtvm_ffi.so: not a regular file (links and devices are refused)"]
    assert installed_files(tmp_path / "p2") == {}


def test_a_file_swapped_after_the_check_is_never_installed(package, device_sysroot, site_pub, tmp_path):
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
    proc = install(package, prefix, device_sysroot, site_pub, path_dirs=[shims],
                   env={"SWAP_WITH": str(evil), "SWAP_TARGET": str(package / "model.so"),
                        "SWAP_DONE": str(tmp_path / "swapped")})
    assert (tmp_path / "swapped").exists() and sha256_file(package / "model.so") == sha256_file(evil)
    assert proc.returncode == 0, proc.stderr
    assert sha256_file(prefix / "model.so") == original and "selftest PASS" in proc.stdout


def test_a_failing_selftest_leaves_the_installed_package_as_it_was(package, device_sysroot, site_pub, tmp_path,
                                                                   edge_package):
    """Golden outputs this model does not reproduce, signed by the site: the old install stays."""
    import numpy as np

    prefix = tmp_path / "prefix"
    assert install(unpack(edge_package, tmp_path / "v1"), prefix, device_sysroot, site_pub).returncode == 0
    before = installed_files(prefix)
    expected = np.load(package / "selftest/expected.npy")
    np.save(package / "selftest/expected.npy", expected[::-1].copy())
    resign(package)
    for _ in range(2):  # and the second run is not taken for an installed package
        proc = upgrade(prefix, package, device_sysroot)
        assert proc.returncode == 1
        assert "selftest FAIL: 8 golden samples" in proc.stdout
        assert proc.stderr.strip().splitlines() == [
            f"install.sh: error: {package}: bin/run --selftest failed: the model does not reproduce the host's "
            f"outputs on this device; {prefix} left as it was"]
        assert installed_files(prefix) == before


def test_an_install_by_the_earlier_installer_is_taken_over(package, device_sysroot, site_pub, tmp_path):
    """The earlier install.sh kept only DIR/.installed and DIR/SHA256SUMS: those say what it owns."""
    prefix = tmp_path / "prefix"
    assert install(package, prefix, device_sysroot, site_pub).returncode == 0
    shutil.rmtree(prefix / ".appliance-edge")
    (prefix / "SHA256SUMS.minisig").unlink()  # it signed nothing
    (prefix / ".installed").write_text(sha256_file(package / "SHA256SUMS") + "\n")
    (prefix / "etc").mkdir()
    (prefix / "etc" / "site.conf").write_text("kept\n")
    proc = install(package, prefix, device_sysroot, site_pub)
    assert proc.returncode == 0, proc.stderr
    assert not (prefix / ".installed").exists() and (prefix / "etc" / "site.conf").read_text() == "kept\n"
    assert sorted((prefix / ".appliance-edge" / "files").read_text().split()) == sorted(installed_files(package))
