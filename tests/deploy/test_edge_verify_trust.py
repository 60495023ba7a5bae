"""`appliance edge verify` trusts only what the site signed: the signature over SHA256SUMS, every
member listed, members inside edge-package/ only; a bad model.json from a signer's tool is one line;
and the gate itself fails with exit status 3."""

import hashlib
import io
import json
import os
import stat
import tarfile

import numpy as np
import pytest

from conftest import one_line as conftest_one_line, run_appliance
from appliance.core import minisign
from appliance.deploy.edge.signing import default_key_path, public_path, site_key


def unpack(tar_path, into):
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    return into / "edge-package"


def repack(root, out, sign_with=None, resum=True, extra=()):
    """root (an unpacked package) as a tar again: re-summed (what anyone can do), signed with
    sign_with when given (what the key's holder can do), plus extra (name, bytes) members."""
    if resum:
        (root / "SHA256SUMS").write_text("".join(
            f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.relative_to(root)}\n" for p in sorted(root.rglob("*"))
            if p.is_file() and p.name not in ("SHA256SUMS", "SHA256SUMS.minisig")))
    if sign_with:
        (root / "SHA256SUMS.minisig").write_text(minisign.sign_file(str(root / "SHA256SUMS"), str(sign_with), "t"))
    with tarfile.open(out, "w") as tar:
        tar.add(root, arcname="edge-package")
        for name, data in extra:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out


def one_line(proc, code=2):
    return conftest_one_line(proc, code)


def test_the_site_key_is_made_once_private_and_carried_public(edge_package, compiled_arm, tmp_path):
    key = default_key_path()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    _, pub, key_id, made = site_key()
    assert not made and pub == public_path(key)
    with tarfile.open(edge_package) as tar:
        carried = tar.extractfile("edge-package/signing-key.pub").read().decode()
        names = tar.getnames()
    assert carried == pub.read_text() and key_id in carried
    assert "edge-package/SHA256SUMS.minisig" in names
    # A key others can read is refused before any work, in one line.
    loose = tmp_path / "loose.key"
    loose.write_text(key.read_text())
    os.chmod(loose, 0o644)
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"), "--key", str(loose))
    assert one_line(proc) == (f"appliance package: error: {loose}: readable by others (mode 0644); chmod 600 it, "
                              "and make a new key if others may have copied it")
    proc = run_appliance("package", str(compiled_arm), "--out", str(tmp_path / "p.tar"), "--key", str(tmp_path / "no.key"))
    assert one_line(proc).startswith(f"appliance package: error: {tmp_path / 'no.key'}: no such signing key")
    assert not (tmp_path / "p.tar").exists()


@pytest.mark.parametrize("name", ["install.sh", "model.so", "bin/run", "model.json"])
def test_a_tampered_resummed_package_is_refused(name, edge_package, tmp_path):
    root = unpack(edge_package, tmp_path / "u")
    path = root / name
    path.write_bytes(path.read_bytes().replace(b"set -eu\n", b"set -eu\ntouch /tmp/pwned\n", 1) + b"\n ")
    tampered = repack(root, tmp_path / "tampered.tar")
    assert one_line(run_appliance("edge", "verify", str(tampered), "--bench-runs", "0")) == (
        f"appliance edge verify: error: {tampered}: edge-package/SHA256SUMS.minisig: signature does not match "
        "SHA256SUMS (the file was changed after signing, or the signature is damaged); refused")


def test_an_unsigned_or_foreign_signed_package_is_refused(edge_package, tmp_path):
    root = unpack(edge_package, tmp_path / "u")
    (root / "SHA256SUMS.minisig").unlink()
    unsigned = repack(root, tmp_path / "unsigned.tar", resum=False)
    assert one_line(run_appliance("edge", "verify", str(unsigned))) == (
        f"appliance edge verify: error: {unsigned}: not signed (no edge-package/SHA256SUMS.minisig); refused: "
        "package it again with `appliance package`, which signs with the site key")
    minisign.write_key_pair(str(tmp_path / "other"), "someone else")
    foreign = repack(root, tmp_path / "foreign.tar", sign_with=tmp_path / "other.key")
    other_id = minisign.key_id_text(minisign.read_public_key(str(tmp_path / "other.pub"))[0])
    site_id = site_key()[2]
    assert one_line(run_appliance("edge", "verify", str(foreign))) == (
        f"appliance edge verify: error: {foreign}: edge-package/SHA256SUMS.minisig: signed by key {other_id}, "
        f"not by the trusted key {site_id}; refused")
    # Trusting that key explicitly is the user's call: then the signature holds and the run goes on.
    proc = run_appliance("edge", "verify", str(foreign), "--pubkey", str(tmp_path / "other.pub"), "--bench-runs", "0")
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("member", ["edge-package/../escaped", "edge-package/./model.so", "edge-package/planted.sh",
                                    "other/file", "/edge-package/abs"])
def test_members_outside_the_package_or_unlisted_are_refused(member, edge_package, tmp_path):
    root = unpack(edge_package, tmp_path / "u")
    bad = repack(root, tmp_path / "bad.tar", resum=False, extra=[(member, b"x")])
    line = one_line(run_appliance("edge", "verify", str(bad)))
    if member == "edge-package/planted.sh":
        assert line == (f"appliance edge verify: error: {bad}: planted.sh is not listed in SHA256SUMS "
                        "(added after packaging)")
    else:
        assert line.startswith(f"appliance edge verify: error: {bad}: member ") and line.endswith("; refused")
    assert not (tmp_path / "escaped").exists()


@pytest.mark.parametrize("change", ["shape", "bytes", "json", "no-mean", "order"])
def test_a_signed_model_json_that_is_wrong_is_one_line(change, edge_package, tmp_path):
    """A site's own signed package whose model.json another tool rewrote: one clean line, no traceback."""
    root = unpack(edge_package, tmp_path / "u")
    info = json.loads((root / "model.json").read_text())
    if change == "shape":
        info["input"]["shape"] = [1, 3, 32, 32]
        (root / "model.json").write_text(json.dumps(info))
    elif change == "bytes":
        (root / "model.json").write_bytes(b'{"input": "\xff\xfe caf\xe9"}')
    elif change == "no-mean":  # the preprocessing keys were a KeyError
        del info["preprocessing"]["mean"], info["preprocessing"]["std"]
        (root / "model.json").write_text(json.dumps(info))
    elif change == "order":
        info["preprocessing"]["channel_order"] = "L"
        (root / "model.json").write_text(json.dumps(info))
    else:
        (root / "model.json").write_text("[" * 5000)
    package = repack(root, tmp_path / "p.tar", sign_with=default_key_path())
    line = one_line(run_appliance("edge", "verify", str(package), "--bench-runs", "0"))
    if change == "json":  # the parser's words differ between Python versions
        assert line.startswith(f"appliance edge verify: error: {package}: model.json: not JSON (")
        return
    assert line == {
        "shape": f"appliance edge verify: error: {package}: model.json: input shape [1, 3, 32, 32] is not the "
                 "reference model's [N, 3, 16, 16]",
        "bytes": f"appliance edge verify: error: {package}: model.json: not UTF-8 text (byte 11)",
        "no-mean": f"appliance edge verify: error: {package}: model.json: preprocessing: missing mean, std (it "
                   "needs image_size, mean, std, channel_order)",
        "order": f"appliance edge verify: error: {package}: model.json: preprocessing: channel_order 'L' does not "
                 "give the input's 3 channel(s)"}[change]


def test_the_gate_fails_with_exit_3_when_the_device_selftest_fails(edge_package, tmp_path):
    """Golden outputs the model does not reproduce, signed by the site: every check before passes,
    the on-device self-test fails, and so does the gate."""
    root = unpack(edge_package, tmp_path / "u")
    expected = np.load(root / "selftest/expected.npy")
    np.save(root / "selftest/expected.npy", expected[::-1].copy())
    package = repack(root, tmp_path / "p.tar", sign_with=default_key_path())
    proc = run_appliance("edge", "verify", str(package), "--bench-runs", "0")
    assert one_line(proc, code=3) == (f"appliance edge verify: error: {package}: edge verification failed: the "
                                      "on-device self-test")
    assert "samples: top-1 agreement 1.0000" in proc.stdout and "FAIL" in proc.stdout


def test_the_gate_fails_with_exit_3_when_the_edge_and_host_disagree(edge_package, tmp_path):
    """The host's reference model negated (signed by the site): the device runs the real model under
    qemu, its top-1 agrees with the host's on no sample, the route fails and so does the gate; the
    on-device self-test, which compares with the package's own golden outputs, still passes."""
    import onnx
    from onnx import helper

    root = unpack(edge_package, tmp_path / "u")
    reference = onnx.load(str(root / "reference" / "model.onnx"))
    output = reference.graph.output[0]
    reference.graph.node.append(helper.make_node("Neg", [output.name], [output.name + "_negated"]))
    output.name += "_negated"
    onnx.save(reference, str(root / "reference" / "model.onnx"))
    package = repack(root, tmp_path / "p.tar", sign_with=default_key_path())
    proc = run_appliance("edge", "verify", str(package), "--bench-runs", "0", "--out", str(tmp_path / "report"))
    assert one_line(proc, code=3) == (f"appliance edge verify: error: {package}: edge verification failed: native "
                                      f"runner (qemu-aarch64) (see {tmp_path / 'report' / 'verify.json'})")
    assert "samples: top-1 agreement 0.0000 (need 1)" in proc.stdout and ": FAIL" in proc.stdout, proc.stdout
    report = json.loads((tmp_path / "report" / "verify.json").read_text())  # written before the exit
    assert report["passed"] is False and report["selftest"]["passed"] is True
