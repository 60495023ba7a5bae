"""minisign files: pure-Python verification (what the offline installer trusts), signing with
`cryptography`, passphrase-protected keys; RFC 8032 vectors and the stock minisign tool."""

import os
import shutil
import stat
import subprocess
import sys

import pytest

from appliance.core import minisign
from conftest import ROOT, VENV_BIN

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


def minisign_g(stock_minisign, base, passphrase):
    """A passphrase-protected key pair made by stock `minisign -G` (passphrase fed on stdin)."""
    proc = subprocess.run([stock_minisign, "-G", "-p", f"{base}.pub", "-s", f"{base}.key"],
                          input=f"{passphrase}\n{passphrase}\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return f"{base}.key", f"{base}.pub"


def test_stock_minisign_encrypted_key_signs_with_its_passphrase_and_only_with_it(tmp_path, stock_minisign,
                                                                                monkeypatch):
    key, pub = minisign_g(stock_minisign, tmp_path / "m", "correct horse")
    payload = tmp_path / "bundle.tar"
    payload.write_bytes(b"appliance" * 1000)
    monkeypatch.delenv(minisign.PASSPHRASE_ENV, raising=False)
    monkeypatch.delenv(minisign.PASSPHRASE_FILE_ENV, raising=False)
    with pytest.raises(minisign.SignatureError, match=f"passphrase-protected key: set {minisign.PASSPHRASE_ENV}"):
        minisign.read_secret_key(key)
    with pytest.raises(minisign.SignatureError, match="wrong passphrase"):
        minisign.read_secret_key(key, "wrong horse")
    (tmp_path / "pass").write_text("correct horse\n")
    monkeypatch.setenv(minisign.PASSPHRASE_FILE_ENV, str(tmp_path / "pass"))
    (tmp_path / "bundle.tar.minisig").write_text(minisign.sign_file(str(payload), key, "from an encrypted key"))
    proc = subprocess.run([stock_minisign, "-V", "-m", str(payload), "-p", pub], capture_output=True, text=True)
    assert proc.returncode == 0 and "from an encrypted key" in proc.stdout, proc.stderr


def test_keygen_encrypted_key_is_used_by_stock_minisign(tmp_path, stock_minisign):
    (tmp_path / "pass").write_text("s3cret passphrase\n")
    proc = subprocess.run([str(VENV_BIN / "appliance"), "bundle", "keygen", "--out", str(tmp_path / "k"),
                           "--passphrase-file", str(tmp_path / "pass")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "(encrypted;" in proc.stderr
    key = tmp_path / "k.key"
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "encrypted secret key" in key.read_text()
    payload = tmp_path / "f"
    payload.write_bytes(b"data" * 100)
    proc = subprocess.run([stock_minisign, "-S", "-s", str(key), "-m", str(payload), "-t", "stock, our key"],
                          input="s3cret passphrase\n", capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert minisign.verify_file(str(payload), f"{payload}.minisig", str(tmp_path / "k.pub")) == "stock, our key"
    # A wrong passphrase is refused by minisign as well: the key really is encrypted.
    proc = subprocess.run([stock_minisign, "-S", "-s", str(key), "-m", str(payload)], input="nope\n",
                          capture_output=True, text=True)
    assert proc.returncode != 0


def test_keygen_refuses_to_overwrite_and_force_replaces_a_wide_mode(tmp_path):
    cmd = [str(VENV_BIN / "appliance"), "bundle", "keygen", "--out", str(tmp_path / "k")]
    assert subprocess.run(cmd, capture_output=True, text=True).returncode == 0
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (f"appliance bundle keygen: error: {tmp_path / 'k.pub'}: exists; refusing to "
                                   "overwrite a key (pass --force)")
    proc = subprocess.run([*cmd[:-1], str(tmp_path / "e"), "--encrypt"], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL,
                          env={k: v for k, v in os.environ.items() if not k.startswith("APPLIANCE_SIGN_")})
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"appliance bundle keygen: error: --encrypt: no passphrase: set {minisign.PASSPHRASE_ENV} or "
        f"{minisign.PASSPHRASE_FILE_ENV}, pass --passphrase-file, or run on a terminal")
    assert not (tmp_path / "e.key").exists()
    os.chmod(tmp_path / "k.key", 0o644)
    assert subprocess.run(cmd + ["--force"], capture_output=True, text=True).returncode == 0
    assert stat.S_IMODE((tmp_path / "k.key").stat().st_mode) == 0o600


def test_verification_needs_only_the_standard_library(tmp_path):
    """What the air-gapped installer does: no site-packages (-S), so no cryptography to lean on."""
    payload = tmp_path / "f"
    payload.write_bytes(b"offline" * 100)
    pub_text, key_text, _ = minisign.generate_key_pair("test")
    (tmp_path / "k.pub").write_text(pub_text)
    (tmp_path / "k.key").write_text(key_text)
    (tmp_path / "f.minisig").write_text(minisign.sign_file(str(payload), str(tmp_path / "k.key"), "ok"))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import minisign; "
            "print(minisign.verify_file(sys.argv[2], sys.argv[3], sys.argv[4])); "
            "assert not any(m.startswith(('cryptography', 'appliance')) for m in sys.modules), sorted(sys.modules)")
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(ROOT / "appliance" / "core"), str(payload),
                           str(tmp_path / "f.minisig"), str(tmp_path / "k.pub")], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


def test_bundle_build_signs_with_a_stock_minisign_encrypted_key(tmp_path, tmp_path_factory, stock_minisign,
                                                                monkeypatch):
    import bundle_kit

    key, pub = minisign_g(stock_minisign, tmp_path / "site", "bundle pass")
    cache = tmp_path_factory.getbasetemp() / "bundles" / "cache"  # shared with bundle_kit's builds
    cache.mkdir(parents=True, exist_ok=True)
    monkeypatch.delenv(minisign.PASSPHRASE_ENV, raising=False)
    monkeypatch.delenv(minisign.PASSPHRASE_FILE_ENV, raising=False)
    out = tmp_path / "out"
    proc = bundle_kit.build(out, "--profile", "test", "--sign-key", key, cache=cache)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"appliance bundle build: error: {key}: passphrase-protected key: set {minisign.PASSPHRASE_ENV}, or "
        f"{minisign.PASSPHRASE_FILE_ENV} to a file holding the passphrase"]
    (tmp_path / "wrong").write_text("bundle pas\n")
    monkeypatch.setenv(minisign.PASSPHRASE_FILE_ENV, str(tmp_path / "wrong"))
    proc = bundle_kit.build(out, "--profile", "test", "--sign-key", key, cache=cache)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"appliance bundle build: error: {key}: wrong passphrase (or a damaged key file)"]
    assert not list(out.glob("*.tar"))  # refused before anything was downloaded or written

    monkeypatch.delenv(minisign.PASSPHRASE_FILE_ENV)
    monkeypatch.setenv(minisign.PASSPHRASE_ENV, "bundle pass")
    proc = bundle_kit.build(out, "--profile", "test", "--sign-key", key, cache=cache)
    assert proc.returncode == 0, proc.stderr
    [tar] = out.glob("appliance-bundle-*.tar")
    proc = subprocess.run([stock_minisign, "-V", "-m", str(tar), "-p", pub], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
