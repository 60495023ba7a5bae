"""The pure-Python Ed25519/minisign code the offline installer trusts: RFC 8032 vectors and stock minisign."""

import shutil
import subprocess

import pytest

from appliance.bundle import minisign

# RFC 8032, section 7.1: TEST 1, 2 and 3 (secret seed, public key, message, signature).
RFC8032 = [
    ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
     "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
     "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc61e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"),
    ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
     "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
     "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"),
    ("c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
     "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
     "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae67f760984dc6594a7c15e9716ed28dc027beceea1ec40a"),
]


@pytest.mark.parametrize("seed, public, message, signature", RFC8032, ids=["test1", "test2", "test3"])
def test_rfc8032_vectors(seed, public, message, signature):
    seed, public, message, signature = (bytes.fromhex(x) for x in (seed, public, message, signature))
    assert minisign.ed25519_public_key(seed) == public
    assert minisign.ed25519_sign(seed, message) == signature
    assert minisign.ed25519_verify(public, message, signature)


def test_verify_rejects_any_change():
    seed, public, _, _ = (bytes.fromhex(x) for x in RFC8032[2])
    message = b"appliance-bundle-0.1.0.tar"
    signature = minisign.ed25519_sign(seed, message)
    assert minisign.ed25519_verify(public, message, signature)
    assert not minisign.ed25519_verify(public, message + b"x", signature)
    for i in (0, 31, 32, 63):  # R and S halves
        bad = bytearray(signature)
        bad[i] ^= 1
        assert not minisign.ed25519_verify(public, message, bytes(bad))
    # S >= L (malleability): the same signature with L added to S must not verify.
    s = int.from_bytes(signature[32:], "little") + minisign._L
    assert not minisign.ed25519_verify(public, message, signature[:32] + s.to_bytes(32, "little"))
    assert not minisign.ed25519_verify(bytes(32), message, signature)


@pytest.fixture
def stock_minisign():
    path = shutil.which("minisign")
    if path is None:
        pytest.fail("minisign is required to prove interoperability (apt-get install minisign; "
                    "installer/bootstrap.sh --system installs it)")
    return path


def test_stock_minisign_verifies_our_signature_and_we_verify_its(tmp_path, stock_minisign):
    payload = tmp_path / "bundle.tar"
    payload.write_bytes(b"\x00appliance\n" * 5000)
    pub_text, key_text, key_id = minisign.generate_key_pair("test")
    (tmp_path / "our.pub").write_text(pub_text)
    (tmp_path / "our.key").write_text(key_text)
    (tmp_path / "bundle.tar.minisig").write_text(minisign.sign_file(str(payload), str(tmp_path / "our.key")))
    proc = subprocess.run([stock_minisign, "-V", "-m", str(payload), "-p", str(tmp_path / "our.pub")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "verified" in proc.stdout

    # The other way: a key and a signature made by minisign itself.
    subprocess.run([stock_minisign, "-G", "-W", "-p", str(tmp_path / "m.pub"), "-s", str(tmp_path / "m.key")],
                   check=True, capture_output=True)
    subprocess.run([stock_minisign, "-S", "-s", str(tmp_path / "m.key"), "-m", str(payload), "-x",
                    str(tmp_path / "m.minisig"), "-t", "made by stock minisign"], check=True, capture_output=True)
    comment = minisign.verify_file(str(payload), str(tmp_path / "m.minisig"), str(tmp_path / "m.pub"))
    assert comment == "made by stock minisign"
    # minisign signs with a key from our keygen too (its file format is the one minisign reads).
    subprocess.run([stock_minisign, "-S", "-s", str(tmp_path / "our.key"), "-m", str(payload), "-x",
                    str(tmp_path / "o.minisig")], check=True, capture_output=True)
    minisign.verify_file(str(payload), str(tmp_path / "o.minisig"), str(tmp_path / "our.pub"))
    # and our signer accepts minisign's unencrypted key.
    (tmp_path / "x.minisig").write_text(minisign.sign_file(str(payload), str(tmp_path / "m.key")))
    subprocess.run([stock_minisign, "-V", "-m", str(payload), "-x", str(tmp_path / "x.minisig"), "-p",
                    str(tmp_path / "m.pub")], check=True, capture_output=True)

    # Legacy signatures (minisign -l) would need the whole file in memory: refused, clearly.
    subprocess.run([stock_minisign, "-S", "-l", "-s", str(tmp_path / "m.key"), "-m", str(payload), "-x",
                    str(tmp_path / "l.minisig")], check=True, capture_output=True)
    with pytest.raises(minisign.SignatureError, match="legacy"):
        minisign.verify_file(str(payload), str(tmp_path / "l.minisig"), str(tmp_path / "m.pub"))

    # Tampering is caught: the file, the trusted comment, the key.
    payload.write_bytes(payload.read_bytes()[:-1] + b"?")
    with pytest.raises(minisign.SignatureError, match="does not match bundle.tar"):
        minisign.verify_file(str(payload), str(tmp_path / "m.minisig"), str(tmp_path / "m.pub"))
    with pytest.raises(minisign.SignatureError, match="not by the trusted key"):
        minisign.verify_file(str(payload), str(tmp_path / "m.minisig"), str(tmp_path / "our.pub"))


def test_changed_trusted_comment_is_refused(tmp_path):
    payload = tmp_path / "f"
    payload.write_bytes(b"data")
    pub_text, key_text, _ = minisign.generate_key_pair("test")
    (tmp_path / "k.pub").write_text(pub_text)
    (tmp_path / "k.key").write_text(key_text)
    sig = minisign.sign_file(str(payload), str(tmp_path / "k.key"), "version:0.1.1")
    (tmp_path / "f.minisig").write_text(sig.replace("version:0.1.1", "version:9.9.9"))
    with pytest.raises(minisign.SignatureError, match="trusted comment was changed"):
        minisign.verify_file(str(payload), str(tmp_path / "f.minisig"), str(tmp_path / "k.pub"))


def test_password_protected_key_is_refused_with_a_clear_line(tmp_path, stock_minisign):
    proc = subprocess.run([stock_minisign, "-G", "-p", str(tmp_path / "p.pub"), "-s", str(tmp_path / "p.key")],
                          input="pw\npw\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    with pytest.raises(minisign.SignatureError, match="password-protected key"):
        minisign.read_secret_key(str(tmp_path / "p.key"))
