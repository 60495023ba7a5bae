"""Every tampered bundle is refused with one line naming the file, nothing installed, the previous install intact."""

import fcntl
import hashlib
import json
import os
import platform
import tarfile
import select
import subprocess
import sys
import time
from pathlib import Path

import pytest

import bundle_kit
from conftest import offline_cmd
from appliance.core import minisign


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """An appliance with 0.1.0 installed: the previous install every refusal must leave alone."""
    tar, pub = bundle_kit.bundle(tmp_path_factory), bundle_kit.public_key(tmp_path_factory)
    prefix = tmp_path_factory.mktemp("site") / "opt-appliance"
    proc = bundle_kit.install(tar, prefix, pubkey=pub)
    assert proc.returncode == 0, proc.stderr
    key = tmp_path_factory.getbasetemp() / "bundles" / "site.key"
    return {"tar": tar, "pub": pub, "key": key, "prefix": prefix, "state": bundle_kit.state(prefix)}


def sign(tar: Path, key: Path) -> Path:
    Path(f"{tar}.minisig").write_text(minisign.sign_file(str(tar), str(key)))
    return tar


def assert_refused(site, proc, *expected: str) -> str:
    assert proc.returncode == 1, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("refused: "), proc.stderr
    for text in expected:
        assert text in line, line
    assert [ln for ln in proc.stderr.splitlines() if ln.startswith("refused:")] == [line]
    assert bundle_kit.state(site["prefix"]) == site["state"]  # nothing installed, nothing removed
    assert not any(p.name.startswith(".staging-") for p in site["prefix"].iterdir())
    assert bundle_kit.installed(site["prefix"], "--version").stdout.strip() == "appliance 0.1.0"
    return line


def six_wheel(name: str) -> bool:
    return name.endswith(".whl") and "/wheelhouse/six-" in name


def flip_byte(name, data):
    if six_wheel(name):
        data = bytearray(data)
        data[len(data) // 2] ^= 0x01
        return bytes(data)
    return data


def test_flipped_byte_in_a_wheel_breaks_the_signature(site, tmp_path):
    tar = bundle_kit.rewrite_tar(site["tar"], tmp_path / site["tar"].name, change=flip_byte)
    Path(f"{tar}.minisig").write_bytes(Path(f"{site['tar']}.minisig").read_bytes())
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    assert_refused(site, proc, f"{tar}.minisig: signature does not match {tar.name}")


def test_flipped_byte_in_a_wheel_is_caught_by_sha256sums_when_unsigned(site, tmp_path):
    tar = bundle_kit.rewrite_tar(site["tar"], tmp_path / "b.tar", change=flip_byte)
    proc = bundle_kit.install(tar, site["prefix"], "--allow-unsigned")
    assert_refused(site, proc, "refused: wheelhouse/six-1.17.0-py2.py3-none-any.whl: sha256 mismatch")


def test_modified_sha256sums_is_refused(site, tmp_path):
    def change(name, data):
        if name.endswith("/SHA256SUMS"):
            lines = data.decode().splitlines(keepends=True)
            i = next(i for i, ln in enumerate(lines) if "wheelhouse/attrs-" in ln)
            lines[i] = ("0" if lines[i][0] != "0" else "1") + lines[i][1:]
            return "".join(lines).encode()
        return data

    tar = bundle_kit.rewrite_tar(site["tar"], tmp_path / "b.tar", change=change)
    proc = bundle_kit.install(tar, site["prefix"], "--allow-unsigned")
    assert_refused(site, proc, "refused: wheelhouse/attrs-", "sha256 mismatch")
    sign(tar, site["key"])  # even signed by the site's own key, the sums are checked
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    assert_refused(site, proc, "wheelhouse/attrs-", "sha256 mismatch")


def test_file_missing_from_sha256sums_is_refused(site, tmp_path):
    extra = member("appliance-bundle-0.1.0/wheelhouse/extra-1.0-py3-none-any.whl", b"PK\x05\x06" + bytes(18))
    tar = bundle_kit.rewrite_tar(site["tar"], tmp_path / "b.tar", extra=[extra], extra_data={extra.name: b"PK\x05\x06" + bytes(18)})
    proc = bundle_kit.install(tar, site["prefix"], "--allow-unsigned")
    assert_refused(site, proc, "refused: wheelhouse/extra-1.0-py3-none-any.whl: not listed in SHA256SUMS")


def test_a_second_copy_of_a_checked_file_is_refused(site, tmp_path):
    name = "appliance-bundle-0.1.0/installer/install.sh"
    again = member(name, b"#!/bin/sh\nrm -rf /\n")
    tar = bundle_kit.rewrite_tar(site["tar"], tmp_path / "b.tar", extra=[again], extra_data={name: b"#!/bin/sh\nrm -rf /\n"})
    proc = bundle_kit.install(tar, site["prefix"], "--allow-unsigned")
    assert_refused(site, proc, f"refused: {name}: appears twice in the bundle")


def test_wrong_key_damaged_and_missing_signatures_are_refused(site, tmp_path):
    tar = tmp_path / site["tar"].name
    tar.write_bytes(site["tar"].read_bytes())
    pub_text, key_text, other_id = minisign.generate_key_pair("attacker")
    (tmp_path / "other.key").write_text(key_text)
    sign(tar, tmp_path / "other.key")
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    assert_refused(site, proc, f"{tar}.minisig: signed by key {other_id}, not by the trusted key")

    good = Path(f"{site['tar']}.minisig").read_text().splitlines()
    raw = bytearray(__import__("base64").b64decode(good[1]))
    raw[-1] ^= 0x80
    good[1] = __import__("base64").b64encode(bytes(raw)).decode()
    Path(f"{tar}.minisig").write_text("\n".join(good) + "\n")
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    assert_refused(site, proc, "signature does not match")

    Path(f"{tar}.minisig").unlink()
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    assert_refused(site, proc, f"refused: {tar}.minisig: missing: the bundle is unsigned")

    proc = bundle_kit.install(tar, site["prefix"])  # no --pubkey and no --allow-unsigned
    assert_refused(site, proc, f"refused: {tar}: no --pubkey given")
    proc = bundle_kit.install(tar, tmp_path / "new-prefix", pubkey=site["pub"])
    assert proc.returncode == 1 and not (tmp_path / "new-prefix").exists()  # nothing left behind


def member(name: str, data: bytes = b"", kind=tarfile.REGTYPE, target: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size, info.mode = kind, target, len(data), 0o644
    return info


@pytest.mark.parametrize("case", ["dotdot", "absolute", "symlink", "hardlink"])
def test_members_leaving_the_bundle_are_refused_even_when_signed(site, tmp_path, case):
    top = "appliance-bundle-0.1.0"
    evil = tmp_path / "escaped"
    payload = b"owned\n"
    digest = hashlib.sha256(payload).hexdigest()
    if case == "dotdot":
        rel = "../" * 12 + str(evil).lstrip("/")
        info, expected = member(f"{top}/{rel}", payload), "path with '..' leaves the bundle"
    elif case == "absolute":
        info, expected, rel = member(str(evil), payload), "absolute path in the bundle", None
    elif case == "symlink":
        rel, info = None, member(f"{top}/wheelhouse/escape", kind=tarfile.SYMTYPE, target="../" * 12 + "etc")
        expected = "symlink to " + "../" * 12 + "etc leaves the bundle"
    else:
        rel, info = None, member(f"{top}/wheelhouse/passwd", kind=tarfile.LNKTYPE, target="/etc/passwd")
        expected = "hard link to /etc/passwd leaves the bundle"
    # The attacker also lists the file in SHA256SUMS and signs with a stolen key: still refused.
    tar = bundle_kit.rewrite_tar(site["tar"], tmp_path / site["tar"].name, extra=[info],
                                 extra_data={info.name: payload}, sums_extra={rel: digest} if rel else None)
    sign(tar, site["key"])
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    line = assert_refused(site, proc, expected)
    assert line.startswith(f"refused: {info.name}: ")
    assert not evil.exists()


def start_install(bundle_tar: Path, prefix: Path, pubkey: Path) -> subprocess.Popen:
    """bundle_kit.install() in the background, to act while the installer runs."""
    cmd = [str(bundle_kit.INSTALL_SH), str(bundle_tar), "--prefix", str(prefix), "--python",
           bundle_kit.BASE_PYTHON, "--pubkey", str(pubkey)]
    return subprocess.Popen(offline_cmd(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env=bundle_kit.user_env())


def read_until(proc: subprocess.Popen, text: str, timeout: float) -> str:
    """proc's stderr up to the end of the first line holding text (or up to its end or the timeout)."""
    seen, deadline, fd = b"", time.monotonic() + timeout, proc.stderr.fileno()
    while text.encode() not in seen and time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        chunk = os.read(fd, 65536) if ready else b""
        if not chunk:
            break
        seen += chunk
    return seen.decode()


def with_bundle_json(signed: Path, dest: Path, edit) -> Path:
    """signed with bundle.json rewritten by edit(text) and its SHA256SUMS line fixed (signature not redone)."""
    with tarfile.open(signed) as tar:
        name = next(m.name for m in tar.getmembers() if m.name.endswith("/bundle.json"))
        original = tar.extractfile(name).read()
    changed = edit(original.decode()).encode()
    old, new = hashlib.sha256(original).hexdigest().encode(), hashlib.sha256(changed).hexdigest().encode()

    def change(member_name, data):
        if member_name == name:
            return changed
        return data.replace(old, new) if member_name.endswith("/SHA256SUMS") else data

    return bundle_kit.rewrite_tar(signed, dest, change=change)


def consistent_but_unsigned(signed: Path, dest: Path) -> Path:
    """Passes every check but the signature."""
    return with_bundle_json(signed, dest, lambda text: text.replace("{", '{"swapped": "unsigned code",', 1))


def retarget(platform: str | None = None, python: str | None = None):
    """An edit of bundle.json that moves the test profile to another platform or CPython."""
    def edit(text: str) -> str:
        manifest = json.loads(text)
        profile = manifest["profiles"]["test"]
        if platform:
            profile["platform"] = platform
        if python:
            profile["python"] = python
            if "pythons" in profile:
                profile["pythons"] = [python]
            if "by_python" in profile:  # one lock, now claiming to be for that CPython
                first = next(iter(profile["by_python"].values()))
                profile["by_python"] = {python: {**first, "python": python}}
        return json.dumps(manifest, indent=2)
    return edit


def test_bundle_for_another_platform_names_what_it_holds_and_what_this_host_is(site, tmp_path):
    tar = sign(with_bundle_json(site["tar"], tmp_path / site["tar"].name, retarget("aarch64-manylinux_2_28")),
               site["key"])
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    machine, (libc, version) = platform.machine(), platform.libc_ver()
    python = "%d.%d" % sys.version_info[:2]
    with tarfile.open(site["tar"]) as t:
        member = next(m for m in t.getmembers() if m.name.endswith("/bundle.json"))
        served = "/".join(json.load(t.extractfile(member))["profiles"]["test"]["pythons"])
    assert_refused(site, proc, f"refused: {tar}: no installable profile for this host ({machine}, CPython {python} "
                   f"({bundle_kit.BASE_PYTHON}), {libc} {version}); the bundle holds "
                   f"test (aarch64-manylinux_2_28, CPython {served})")


def test_bundle_for_another_python_names_what_it_holds(site, tmp_path):
    tar = sign(with_bundle_json(site["tar"], tmp_path / site["tar"].name, retarget(python="3.99")), site["key"])
    proc = bundle_kit.install(tar, site["prefix"], pubkey=site["pub"])
    line = assert_refused(site, proc, "3.99", "%d.%d" % sys.version_info[:2])
    assert line.endswith(f"; the bundle holds test ({platform.machine()}-manylinux_2_28, CPython 3.99)"), line


@pytest.mark.parametrize("swap", ["rename", "overwrite"])
def test_bundle_swapped_after_the_signature_check_installs_the_verified_bytes(site, tmp_path, swap):
    """Issue 18's attack: hold PREFIX/.install.lock so the installer stalls right after its signature
    check, replace BUNDLE by an unsigned one whose SHA256SUMS agree, let go. The installer must install
    what it verified (or refuse), never the swapped file."""
    carried = tmp_path / "usb" / site["tar"].name
    carried.parent.mkdir()
    carried.write_bytes(site["tar"].read_bytes())
    Path(f"{carried}.minisig").write_bytes(Path(f"{site['tar']}.minisig").read_bytes())
    signed_sha = hashlib.sha256(carried.read_bytes()).hexdigest()
    evil = consistent_but_unsigned(carried, tmp_path / "evil.tar")
    prefix = tmp_path / "opt-appliance"
    prefix.mkdir()
    lock = os.open(prefix / ".install.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(lock, fcntl.LOCK_EX)
    proc = start_install(carried, prefix, pubkey=site["pub"])
    try:
        seen = read_until(proc, "signature: verified", timeout=120)
        assert "signature: verified" in seen, seen
        time.sleep(0.5)
        assert proc.poll() is None  # stalled on the lock we hold, after the check
        if swap == "rename":
            os.replace(evil, carried)
        else:  # same inode, new bytes: defeats a fix that only holds on to the file's inode
            with open(carried, "r+b") as f:
                f.write(evil.read_bytes())
                f.truncate()
        assert hashlib.sha256(carried.read_bytes()).hexdigest() != signed_sha
    finally:
        os.close(lock)
    stderr = seen + proc.communicate(timeout=600)[1].decode()
    assert proc.returncode == 0, stderr
    record = json.loads((prefix / "current" / "install.json").read_text())
    assert record["bundle_sha256"] == signed_sha and record["version"] == "0.1.0"
    installed = (prefix / "current" / "bundle" / "bundle.json").read_bytes()
    assert b"swapped" not in installed and json.loads(installed)["version"] == "0.1.0"
    assert bundle_kit.installed(prefix, "--version").stdout.strip() == "appliance 0.1.0"
    assert not any(p.name.startswith(".staging-") for p in prefix.iterdir())


def test_a_killed_installers_copy_is_swept_and_a_live_ones_is_kept(site, tmp_path):
    """The private copy is made before the install lock; the sweep of stale work directories must
    not delete the copy of an installer that is still verifying (it holds a flock on it)."""
    prefix = tmp_path / "opt-appliance"
    dead, live = prefix / ".staging-dead", prefix / ".staging-live"
    for d in (dead, live):
        d.mkdir(parents=True, mode=0o700)
        (d / ".in-use").write_text("")
        (d / "bundle.tar").write_bytes(b"partial copy")
    fd = os.open(live / ".in-use", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = bundle_kit.install(site["tar"], prefix, pubkey=site["pub"])
    finally:
        os.close(fd)
    assert proc.returncode == 0, proc.stderr
    assert not dead.exists() and (live / "bundle.tar").read_bytes() == b"partial copy"


def test_a_prefix_every_user_can_write_is_refused(site, tmp_path):
    prefix = tmp_path / "shared"
    prefix.mkdir()
    prefix.chmod(0o777)
    proc = bundle_kit.install(site["tar"], prefix, pubkey=site["pub"])
    assert proc.returncode == 1
    assert proc.stderr.strip() == (f"refused: {prefix}: writable by every user: anyone could change what gets "
                                   "installed (chmod o-w it)")
    assert list(prefix.iterdir()) == []
