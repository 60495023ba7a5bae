"""The re-run of issue 31's campaign against `appliance bundle audit`, with cases the first round did
not list: a bundle path that is a FIFO or a link to /dev/zero (waited on or read forever before), and
a bundle.json or SBOM that is nested 100000 deep or of other types (internal errors before). Small
hand-made tars through the real CLI; no bundle build."""

import hashlib
import io
import os
import tarfile

import pytest

from conftest import one_line as conftest_one_line, run_appliance

TOP = "appliance-bundle-9.9.9"


def make_bundle(path, bundle_json: bytes, sbom: bytes | None = None):
    files = {f"{TOP}/bundle.json": bundle_json}
    if sbom is not None:
        files[f"{TOP}/sbom.json"] = sbom
    files[f"{TOP}/SHA256SUMS"] = "".join(f"{hashlib.sha256(d).hexdigest()}  {n.split('/', 1)[1]}\n"
                                         for n, d in files.items()).encode()
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def one_line(proc, code=2):
    return conftest_one_line(proc, code)


@pytest.mark.parametrize("kind", ["a FIFO", "a link to /dev/zero"])
def test_a_bundle_path_that_is_no_file_is_one_line_and_never_waited_on(kind, tmp_path):
    bundle = tmp_path / "appliance-bundle-9.9.9.tar"
    os.mkfifo(bundle) if kind == "a FIFO" else bundle.symlink_to("/dev/zero")
    proc = run_appliance("bundle", "audit", str(bundle), timeout=60)
    assert one_line(proc) == (f"appliance bundle audit: error: {bundle}: not a regular file (a device or a pipe), "
                              "so not a bundle tar")


PROFILE = b'{"profiles": {"cpu": {"python": "3.11", "sbom": "sbom.json"}}}'
CASES = {
    "bundle.json nested": (b"[" * 100_000 + b"]" * 100_000, None,
                           f"{TOP}/bundle.json is not JSON (maximum recursion depth exceeded while decoding a JSON "
                           "array from a unicode string)"),
    "bundle.json a list": (b"[1, 2]", None, f"{TOP}/bundle.json or an SBOM is not as `appliance bundle build` "
                                            "writes it (AttributeError: 'list' object has no attribute 'get')"),
    "a profile without an SBOM": (b'{"profiles": {"cpu": {"python": "3.11"}}}', None,
                                  f"{TOP}/bundle.json or an SBOM is not as `appliance bundle build` writes it "
                                  "(KeyError: 'sbom')"),
    "an SBOM nested": (PROFILE, b"[" * 100_000 + b"]" * 100_000,
                       "sbom.json is not JSON (maximum recursion depth exceeded while decoding a JSON array from a "
                       "unicode string)"),
    "an SBOM of other types": (PROFILE, b'{"metadata": {"properties": [{"name": "appliance:vulnerability_data", '
                                        b'"value": "offered"}]}, "vulnerabilities": [{"affects": [5]}]}',
                               f"{TOP}/bundle.json or an SBOM is not as `appliance bundle build` writes it "
                               "(TypeError: 'int' object is not subscriptable)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_bundle_json_or_sbom_of_another_shape_is_one_line(case, tmp_path):
    bundle_json, sbom, expected = CASES[case]
    bundle = make_bundle(tmp_path / "b.tar", bundle_json, sbom)
    proc = run_appliance("bundle", "audit", str(bundle), timeout=60)
    assert one_line(proc) == f"appliance bundle audit: error: {bundle}: {expected}"


# installer/install.sh (the air-gapped side): the same shapes, unsigned on purpose (--allow-unsigned), and a
# bundle path that is a FIFO or a folder.

def run_installer(*args):
    import subprocess

    from conftest import ROOT

    return subprocess.run(["bash", str(ROOT / "installer" / "install.sh"), *map(str, args)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("bundle_json", [b"{}", b'{"profiles": 5}', b"[1, 2]"])
def test_the_installer_refuses_a_bundle_json_of_another_shape_in_one_line(bundle_json, tmp_path):
    bundle = make_bundle(tmp_path / "b.tar", bundle_json)
    proc = run_installer(bundle, "--allow-unsigned", "--prefix", tmp_path / "prefix")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(
        f"refused: {bundle}: bundle.json (or a record it names) is not as `appliance bundle build` writes it (")
    assert not (tmp_path / "prefix" / "current").exists()


@pytest.mark.parametrize("kind", ["a FIFO", "a folder"])
def test_the_installer_names_a_bundle_path_that_is_no_file(kind, tmp_path):
    bundle = tmp_path / "b.tar"
    os.mkfifo(bundle) if kind == "a FIFO" else bundle.mkdir()
    proc = run_installer(bundle, "--allow-unsigned", "--prefix", tmp_path / "prefix")
    assert proc.returncode == 1 and proc.stderr.strip().splitlines() == [
        f"refused: {bundle}: not a regular file (a folder, device or pipe), so not a bundle"]
