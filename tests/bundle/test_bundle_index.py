"""`appliance bundle build` through pip against a PEP 503 HTML-only index served on loopback."""

import hashlib
import json
import re
import tarfile

import pytest

import bundle_kit


@pytest.mark.parametrize("configured_by", ["PIP_INDEX_URL", "pip.conf"])
def test_build_from_an_html_only_index_on_loopback(tmp_path, tmp_path_factory, configured_by):
    index = bundle_kit.simple_index(tmp_path / "index", bundle_kit.cached_wheels(tmp_path_factory))
    with bundle_kit.Served(index) as served:
        out = tmp_path / "out"
        env = bundle_kit.pip_env(f"{served.url}/simple")
        if configured_by == "pip.conf":  # the site's pip.conf names the mirror, as pip itself reads it
            del env["PIP_INDEX_URL"]
            env["PIP_CONFIG_FILE"] = str(tmp_path / "pip.conf")
            (tmp_path / "pip.conf").write_text(f"[global]\nindex-url = {served.url}/simple\n")
        proc = bundle_kit.build(out, "--profile", "test", cache=tmp_path / "cache", env=env)
        log = served.log()
    assert proc.returncode == 0, proc.stderr
    # pip read the HTML pages and took every file from this index (its only one).
    for name in ("attrs", "packaging", "python-dateutil", "six", "tomli-w", "tzdata", "uv"):
        assert f"GET /simple/{name}/ HTTP/1.1\" 200" in log, log
    assert "GET /files/six-1.17.0-py2.py3-none-any.whl HTTP/1.1\" 200" in log
    with tarfile.open(out / "appliance-bundle-0.1.0.tar") as tar:
        top = "appliance-bundle-0.1.0"
        manifest = json.load(tar.extractfile(f"{top}/bundle.json"))
        for python, variant in manifest["profiles"]["test"]["by_python"].items():
            lock = tar.extractfile(f"{top}/{variant['lock']}").read().decode()
            assert f"--python-version {python} " in lock.splitlines()[1] + " "
            for w in variant["wheels"]:
                data = tar.extractfile(f"{top}/{w['file']}").read()
                assert hashlib.sha256(data).hexdigest() == w["sha256"] and w["sha256"] in lock
    params = json.loads((out / "manifest.json").read_text())["params"]
    assert params["index"] == f"{served.url}/simple"


def test_broken_html_index_fails_naming_each_package_and_writes_nothing(tmp_path, tmp_path_factory):
    index = bundle_kit.simple_index(tmp_path / "index", bundle_kit.cached_wheels(tmp_path_factory))
    for page in (index / "simple" / "six").iterdir():  # the index lost six: its page answers 404
        page.unlink()
    (index / "simple" / "six").rmdir()
    tampered = next((index / "files").glob("tomli_w-*.whl"))  # and serves another file under tomli-w's name
    tampered.write_bytes(tampered.read_bytes() + b"tampered")
    page = index / "simple" / "tomli-w" / "index.html"
    page.write_text(re.sub(r"#sha256=[0-9a-f]{64}", "", page.read_text()))
    out = tmp_path / "out"
    with bundle_kit.Served(index) as served:
        proc = bundle_kit.build(out, "--profile", "test", cache=tmp_path / "cache",
                                env=bundle_kit.pip_env(f"{served.url}/simple"))
    assert proc.returncode == 2
    for python in ("3.11", "3.12"):
        assert (f"bundle: missing: test (CPython {python}): six==1.17.0: no wheel for CPython {python} "
                "x86_64-manylinux_2_28; the index has no wheel of it") in proc.stderr
        assert re.search(rf"bundle: mismatch: test \(CPython {re.escape(python)}\): tomli-w==1\.2\.0: "
                         r"tomli_w-1\.2\.0-py3-none-any\.whl from the index has sha256 [0-9a-f]{64}, "
                         r"not one the lock allows", proc.stderr), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"appliance bundle build: error: 4 locked wheel(s) missing or mismatched (six, tomli-w; listed above); "
        f"nothing was written to {out}")
    assert not out.exists()
