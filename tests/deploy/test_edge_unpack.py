"""`appliance edge verify` unpacks a package safely with or without PEP 706's tarfile filter
(Python < 3.11.4 has none: Debian 12's python3.11 is 3.11.2, the interpreter a site installs with)."""

import hashlib
import io
import os
import stat
import tarfile

import pytest

from appliance.deploy.verify import unpack_checked
from appliance.core.errors import DataError


def add(tar, name, data=b"", kind=tarfile.REGTYPE, mode=0o644, link=""):
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.linkname, info.size = kind, mode, link, len(data)
    tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)


def package(path, extra=None):
    files = {"bin/run": (b"#!/bin/sh\n", 0o4755), "model/meta.json": (b"{}", 0o644)}
    with tarfile.open(path, "w") as tar:
        add(tar, "edge-package/SHA256SUMS",
            "".join(f"{hashlib.sha256(d).hexdigest()}  {n}\n" for n, (d, _) in files.items()).encode())
        for name, (data, mode) in files.items():
            add(tar, f"edge-package/{name}", data, mode=mode)
        if extra:
            extra(tar)
    return path


@pytest.fixture(params=["with filter", "without filter"])
def python_tarfile(request, monkeypatch):
    if request.param == "without filter":
        monkeypatch.delattr(tarfile, "data_filter", raising=False)
    return request.param


def test_a_package_unpacks_and_loses_setuid(tmp_path, python_tarfile):
    root = unpack_checked(package(tmp_path / "p.tar"), tmp_path / "into")
    assert (root / "model" / "meta.json").read_bytes() == b"{}"
    mode = stat.S_IMODE(os.stat(root / "bin" / "run").st_mode)
    assert mode & 0o100 and not mode & stat.S_ISUID, oct(mode)


@pytest.mark.parametrize("member", [
    lambda tar: add(tar, "edge-package/../../escaped", b"x"),
    lambda tar: add(tar, "edge-package/lib/link", kind=tarfile.SYMTYPE, link="../../../../etc/passwd"),
    lambda tar: add(tar, "edge-package/lib/hard", kind=tarfile.LNKTYPE, link="/etc/passwd"),
], ids=["dotdot", "symlink-out", "hardlink-out"])
def test_members_reaching_outside_are_refused_in_one_line(tmp_path, python_tarfile, member):
    tar = package(tmp_path / "p.tar", member)
    with pytest.raises(DataError) as err:
        unpack_checked(tar, tmp_path / "into")
    assert str(tar) in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "escaped").exists()


def test_an_absolute_member_never_lands_outside(tmp_path, python_tarfile):
    """Refused by its name, before anything is extracted, with or without the filter."""
    outside = tmp_path / "outside-absolute"
    tar = package(tmp_path / "p.tar", lambda t: add(t, str(outside), b"x"))
    with pytest.raises(DataError) as err:
        unpack_checked(tar, tmp_path / "into")
    assert str(outside) in str(err.value) and "\n" not in str(err.value)
    assert not outside.exists()
