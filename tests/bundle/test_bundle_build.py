"""`appliance bundle build` of the small `test` profile: real downloads, real tar, real signature."""

import hashlib
import json
import re
import stat
import subprocess
import tarfile

import pytest

import bundle_kit
from appliance.core import minisign
from conftest import VENV_BIN


def members(tar_path):
    with tarfile.open(tar_path) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        return top, {m.name[len(top) + 1:]: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_bundle_holds_locked_wheels_sums_sbom_manifest_and_a_minisign_signature(tmp_path_factory):
    tar_path = bundle_kit.bundle(tmp_path_factory)
    top, files = members(tar_path)
    assert top == "appliance-bundle-0.1.0"
    assert {"bundle.json", "SHA256SUMS", "installer/install.sh", "installer/install_bundle.py", "installer/verify_bundle.py",
            "installer/minisign.py"} <= set(files)

    # SHA256SUMS covers every other file, with the right hashes (what `sha256sum -c` checks).
    sums = dict(reversed(line.split("  ", 1)) for line in files["SHA256SUMS"].decode().splitlines())
    assert set(sums) == set(files) - {"SHA256SUMS"}
    assert all(hashlib.sha256(files[n]).hexdigest() == h for n, h in sums.items())

    # One lock and SBOM per Python the profile serves, each resolved for that version.
    for python in ("3.11", "3.12"):
        assert {f"profiles/test/py{python}/requirements.lock", f"profiles/test/py{python}/sbom.cdx.json"} <= set(files)
        header = files[f"profiles/test/py{python}/requirements.lock"].decode().splitlines()[1]
        assert f"--python-version {python} --python-platform x86_64-manylinux_2_28" in header

    # Exactly the locked files: each wheel's hash is one the lock allows, and every pin has its wheel.
    lock = files["profiles/test/py3.11/requirements.lock"].decode()
    pinned = dict(re.findall(r"(?m)^([a-z0-9-]+)==\S+ \\\n((?:\s+--hash=sha256:[0-9a-f]{64}.*\n?)+)", lock))
    assert set(pinned) == {"attrs", "packaging", "python-dateutil", "six", "tomli-w", "tzdata", "uv", "appliance"}
    wheels = {n: d for n, d in files.items() if n.startswith("wheelhouse/")}
    assert len(wheels) == len(pinned)
    for name, data in wheels.items():
        assert name.endswith(".whl")  # binary only
        assert hashlib.sha256(data).hexdigest() in lock, name
    project = next(n for n in wheels if n.startswith("wheelhouse/appliance-0.1.0-"))
    assert hashlib.sha256(wheels[project]).hexdigest() in pinned["appliance"]

    manifest = json.loads(files["bundle.json"])
    assert manifest["version"] == "0.1.0" and manifest["made_by"].startswith("appliance bundle build")
    assert manifest["platforms"] == ["x86_64-manylinux_2_28"]
    assert manifest["glibc_floor"] == "2.28" and manifest["python"] == ["3.11", "3.12"] and manifest["cuda_major"] == []
    profile = manifest["profiles"]["test"]
    assert profile["install"] is True and profile["self_test"]["doctor"] == "json"
    assert profile["pythons"] == ["3.11", "3.12"] and set(profile["by_python"]) == {"3.11", "3.12"}
    assert {w["file"] for w in profile["wheels"]} == set(wheels)
    for python, variant in profile["by_python"].items():
        assert variant["lock"] == f"profiles/test/py{python}/requirements.lock"
        assert {w["file"] for w in variant["wheels"]} == set(wheels)  # the test profile's wheels are all py3

    sbom = json.loads(files["profiles/test/py3.11/sbom.cdx.json"])
    assert sbom["bomFormat"] == "CycloneDX" and sbom["specVersion"] == "1.6"
    components = {c["name"]: c for c in sbom["components"]}
    assert set(components) == set(pinned)
    six = components["six"]
    assert six["purl"].startswith(f"pkg:pypi/six@{six['version']}")
    assert six["hashes"][0]["content"] == hashlib.sha256(wheels[f"wheelhouse/{six['purl'].split('file_name=')[1]}"]).hexdigest()
    assert "MIT" in json.dumps(six.get("licenses"))

    # Signed: stock minisign verifies it, and so does the installer's pure-Python verifier.
    pub = bundle_kit.public_key(tmp_path_factory)
    comment = minisign.verify_file(str(tar_path), f"{tar_path}.minisig", str(pub))
    assert "file:appliance-bundle-0.1.0.tar" in comment
    proc = subprocess.run(["minisign", "-V", "-m", str(tar_path), "-p", str(pub)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr

    stage = json.loads((tar_path.parent / "manifest.json").read_text())
    assert stage["stage"] == "bundle"
    assert {o["path"] for o in stage["outputs"]} == {tar_path.name, f"{tar_path.name}.minisig"}


def test_build_lists_every_missing_or_mismatched_wheel_and_writes_nothing(tmp_path, tmp_path_factory):
    src = bundle_kit.source_copy(tmp_path, "0.1.0")
    lock = src / "manifests" / "test.lock"
    text = lock.read_text()
    six_hash = re.search(r"six==1\.17\.0 \\\n\s+--hash=sha256:([0-9a-f]{64})", text).group(1)
    text = text.replace(six_hash, "0" * 64)  # mismatched: the index's file is not the locked one
    text = text.replace("tomli-w==1.2.0", "tomli-w==0.0.1")  # missing: no such release
    lock.write_text(text)
    out = tmp_path / "out"
    proc = bundle_kit.build(out, "--profile", "test", source=src, cache=tmp_path_factory.getbasetemp() / "bundles" / "cache")
    assert proc.returncode == 2
    assert re.search(r"mismatch: test \(CPython 3\.11\): six==1\.17\.0: six-1\.17\.0-py2\.py3-none-any\.whl from the "
                     r"index has sha256 [0-9a-f]{64}, not one the lock allows \(test\.lock\)", proc.stderr), proc.stderr
    assert ("missing: test (CPython 3.11): tomli-w==0.0.1: no wheel for CPython 3.11 x86_64-manylinux_2_28; "
            "the index has none of that version") in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"appliance bundle build: error: 2 locked wheel(s) missing or mismatched (six, tomli-w; listed above); "
        f"nothing was written to {out}")
    assert not out.exists() or not list(out.iterdir())


def test_unknown_profile_and_foreign_lock_are_one_line_errors(tmp_path):
    proc = bundle_kit.build(tmp_path / "out", "--profile", "nope", cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("no profile 'nope' (profiles: edge-aarch64, midsize, openvino, test, trainer-cpu, trainer-cuda)")

    src = bundle_kit.source_copy(tmp_path, "0.1.0")
    lock = src / "manifests" / "test.lock"
    lock.write_text(lock.read_text().replace("x86_64-manylinux_2_28", "aarch64-manylinux_2_28", 1))
    proc = bundle_kit.build(tmp_path / "out", "--profile", "test", source=src, cache=tmp_path / "cache")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"appliance bundle build: error: {lock}: header does not say --python-platform x86_64-manylinux_2_28: "
        "the lock was not resolved for profile test's platform"]


def test_keygen_writes_a_private_secret_key_and_never_overwrites(tmp_path):
    cmd = [str(VENV_BIN / "appliance"), "bundle", "keygen", "--out", str(tmp_path / "k")]
    assert subprocess.run(cmd, capture_output=True).returncode == 0
    assert stat.S_IMODE((tmp_path / "k.key").stat().st_mode) == 0o600
    key_id, seed = minisign.read_secret_key(str(tmp_path / "k.key"))
    assert minisign.read_public_key(str(tmp_path / "k.pub")) == (key_id, minisign.ed25519_public_key(seed))
    before = (tmp_path / "k.key").read_bytes()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2 and "exists; refusing to overwrite a key" in proc.stderr
    assert (tmp_path / "k.key").read_bytes() == before


@pytest.mark.parametrize("name", ["trainer-cuda", "trainer-cpu", "edge-aarch64", "test", "midsize", "openvino"])
def test_every_profile_is_declared_with_its_platform_lock(name):
    from appliance.bundle.profiles import load_profiles, read_lock
    from conftest import ROOT

    profile = load_profiles(ROOT / "manifests")[name]
    pins = {p.name: p.version for p in read_lock(profile, profile.pythons[0])}
    for python in profile.pythons:
        assert all(len(p.hashes) >= 1 for p in read_lock(profile, python))
    if name.startswith("trainer"):
        assert pins["torch"] == "2.14.1" and pins["torchvision"] == "0.29.1" and "apache-tvm" in pins
        # Exactly one distribution provides the `onnxruntime` module.
        assert {"onnxruntime", "onnxruntime-gpu"} & set(pins) == (
            {"onnxruntime-gpu"} if name == "trainer-cuda" else {"onnxruntime"})
    if name == "trainer-cuda":
        assert profile.cuda_major == 13 and pins["nvidia-cuda-runtime"].startswith("13.")
    if name == "edge-aarch64":
        assert profile.arch == "aarch64" and not profile.install
    if name == "openvino":  # an x86 server runs x86_64-openvino packages with this profile's venv
        assert profile.arch == "x86_64" and profile.install and pins["openvino"].startswith("2026.4.")
        assert pins["nncf"] == "3.4.0" and "onnxruntime" in pins


def test_a_pin_with_no_wheel_for_one_of_the_pythons_is_named_before_anything_is_written(tmp_path, tmp_path_factory):
    src = bundle_kit.source_copy(tmp_path, "0.1.0")
    lock = src / "manifests" / "test-py3.12.lock"
    # numpy 1.24.4 has wheels for CPython 3.8 to 3.11 only: the 3.12 lock cannot be served.
    lock.write_text(lock.read_text() + "numpy==1.24.4 \\\n    --hash=sha256:" + "1" * 64 + "\n")
    out = tmp_path / "out"
    cache = tmp_path_factory.getbasetemp() / "bundles" / "cache"
    proc = bundle_kit.build(out, "--profile", "test", source=src, cache=cache)
    assert proc.returncode == 2
    assert ("bundle: missing: test (CPython 3.12): numpy==1.24.4: no wheel for CPython 3.12 x86_64-manylinux_2_28"
            in proc.stderr), proc.stderr
    assert "(CPython 3.11): numpy" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"appliance bundle build: error: 1 locked wheel(s) missing or mismatched (numpy; listed above); "
        f"nothing was written to {out}")
    assert not out.exists()


@pytest.mark.parametrize("pythons, problem", [
    ('["3.11", "3.11"]', "pythons must be a list of distinct CPython versions"),
    ('"3.11"', "pythons must be a list of distinct CPython versions"),
    ('["3.13"]', "test.lock: header does not say --python-version 3.13"),
])
def test_a_profiles_pythons_are_checked(tmp_path, pythons, problem):
    from appliance.bundle.profiles import load_profiles, read_lock
    from appliance.core.errors import ConfigError

    src = bundle_kit.source_copy(tmp_path, "0.1.0")
    toml = src / "manifests" / "profiles.toml"
    toml.write_text(toml.read_text().replace('pythons = ["3.11", "3.12"]', f"pythons = {pythons}"))
    with pytest.raises(ConfigError, match=re.escape(problem)):
        profile = load_profiles(src / "manifests")["test"]
        read_lock(profile, profile.pythons[0])
