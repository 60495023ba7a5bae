"""Bundle member names are compared by the file they extract to (`T/./x`, `T//x` and `T/x` are one
file), and key, signature and list files are read bounded. Small hand-made tars: no bundle build."""

import hashlib
import io
import os
import sys
import tarfile
import time
from pathlib import Path

import pytest

from conftest import ROOT
from appliance.core import minisign

sys.path.insert(0, str(ROOT / "installer"))
import verify_bundle  # noqa: E402
from verify_bundle import Refusal  # noqa: E402

TOP = "appliance-bundle-9.9.9"
LOCK = b"six==1.17.0 --hash=sha256:" + b"0" * 64 + b"\n"


def make_tar(path: Path, members: list[tuple[str, bytes]], sums: list[tuple[str, bytes]] | None = None) -> Path:
    """A tar of TOP/ with these (name, data) members and a SHA256SUMS over `sums` (default: all)."""
    manifest = (f"{TOP}/bundle.json", b"{}")
    listed = [*(members if sums is None else sums), manifest]
    text = "".join(f"{hashlib.sha256(d).hexdigest()}  {n.split('/', 1)[1]}\n" for n, d in listed).encode()
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in [*members, (f"{TOP}/SHA256SUMS", text), manifest]:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def check(tmp_path, members, sums=None):
    tar = make_tar(tmp_path / "b.tar", members, sums)
    (tmp_path / "private").mkdir(mode=0o700)
    copy = verify_bundle.private_copy(tar, tmp_path / "private")
    try:
        return verify_bundle.check_sums(copy, tmp_path / "dest")
    finally:
        copy.close()


@pytest.mark.parametrize("alias", [f"{TOP}/./profiles/mini/requirements.lock",
                                   f"{TOP}/profiles//mini/requirements.lock",
                                   f"{TOP}/profiles/mini/./requirements.lock",
                                   f"{TOP}/profiles/x/../mini/requirements.lock"])
def test_an_alias_of_a_checked_member_is_a_second_copy(tmp_path, alias):
    canonical = f"{TOP}/profiles/mini/requirements.lock"
    evil = b"evil==6.6.6\n"
    with pytest.raises(Refusal) as err:
        # The signer's SHA256SUMS lists both spellings, each with its own hash.
        check(tmp_path, [(canonical, LOCK), (alias, evil)], sums=[(canonical, LOCK), (alias, evil)])
    message = str(err.value)
    assert "appears twice in the bundle" in message or "listed twice" in message or "'..'" in message, message


def test_the_canonical_names_still_pass(tmp_path):
    top, _ = check(tmp_path, [(f"{TOP}/profiles/mini/requirements.lock", LOCK), (f"{TOP}/installer/x.sh", b"#!")])
    assert top == TOP


def test_a_member_listed_under_another_spelling_is_the_same_file(tmp_path):
    member = f"{TOP}/./installer/x.sh"
    top, _ = check(tmp_path, [(member, b"#!")], sums=[(f"{TOP}/installer/x.sh", b"#!")])
    assert top == TOP


def test_sha256sums_listing_a_file_twice_is_refused(tmp_path):
    name = f"{TOP}/installer/x.sh"
    with pytest.raises(Refusal, match=r"SHA256SUMS: line 2: installer/\./x.sh is listed twice"):
        check(tmp_path, [(name, b"#!")], sums=[(name, b"#!"), (f"{TOP}/installer/./x.sh", b"#!")])


def test_an_oversized_sha256sums_is_refused_unread(tmp_path, monkeypatch):
    monkeypatch.setattr(verify_bundle, "MAX_LIST_BYTES", 100)
    names = [(f"{TOP}/wheel-{i}.whl", b"x") for i in range(5)]
    with pytest.raises(Refusal, match="SHA256SUMS: .* bytes, more than"):
        check(tmp_path, names)


@pytest.fixture(scope="module")
def key_pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("keys")
    pub, key, _ = minisign.generate_key_pair("test")
    (base / "k.pub").write_text(pub)
    (base / "k.key").write_text(key)
    (base / "data").write_bytes(b"bundle bytes")
    (base / "data.minisig").write_text(minisign.sign_file(str(base / "data"), str(base / "k.key")))
    return base


@pytest.mark.parametrize("kind, expected", [
    ("zero", "is a device, pipe or socket, not a minisign signature"),
    ("huge", "more than 64 KiB, too large for a minisign signature"),
    ("binary", "not a minisign signature (byte 0 is not UTF-8 text)"),
    ("directory", "is a directory, not a minisign signature"),
])
def test_a_signature_that_is_no_signature_is_refused_without_reading_it(key_pair, tmp_path, kind, expected):
    signature = tmp_path / "data.minisig"
    if kind == "zero":
        os.symlink("/dev/zero", signature)
    elif kind == "huge":
        with open(signature, "wb") as f:
            f.truncate(200 << 20)  # 200 MB, sparse
    elif kind == "binary":
        signature.write_bytes(b"\xff" * 100)
    else:
        signature.mkdir()
    started = time.monotonic()
    with pytest.raises(minisign.SignatureError) as err:
        minisign.verify_file(str(key_pair / "data"), str(signature), str(key_pair / "k.pub"))
    assert str(err.value) == f"{signature}: {expected}"
    assert time.monotonic() - started < 2


def test_a_good_signature_still_verifies(key_pair):
    assert minisign.verify_file(str(key_pair / "data"), str(key_pair / "data.minisig"), str(key_pair / "k.pub"))


def test_a_public_key_that_is_a_device_is_refused(key_pair):
    with pytest.raises(minisign.SignatureError, match="/dev/zero: is a device"):
        minisign.verify_file(str(key_pair / "data"), str(key_pair / "data.minisig"), "/dev/zero")
