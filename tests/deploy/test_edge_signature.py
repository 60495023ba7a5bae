"""The device-side signature check (appliance/deploy/edge/signature.h, what `bin/run --verify-signature`
runs), compiled for this host: RFC 8032's vectors, hashlib, the Python verifier on good and damaged
signatures, and stock minisign's files. The same code runs under qemu in test_edge_install.py."""

import hashlib
import os
import random
import shutil
import subprocess
from pathlib import Path

import pytest

from appliance.core import minisign

EDGE = Path(__file__).resolve().parents[2] / "appliance" / "deploy" / "edge"
DRIVER = r"""
#include "signature.h"
#include <iostream>
// verify FILE SIG PUB | sha512 / blake2b / ed25519 with hex lines on stdin (ed25519: key, signature, message)
int main(int, char** argv) {
  std::string mode = argv[1];
  if (mode == "verify") {
    std::string said;
    bool ok = edgesig::VerifyMinisign(argv[2], argv[3], argv[4], &said);
    std::cout << said << "\n";
    return ok ? 0 : 1;
  }
  std::string line;
  while (std::getline(std::cin, line)) {
    std::vector<uint8_t> b;
    for (size_t i = 0; i + 1 < line.size(); i += 2) b.push_back(std::stoi(line.substr(i, 2), nullptr, 16));
    uint8_t out[64];
    if (mode == "ed25519") {
      std::cout << edgesig::Ed25519Verify(b.data(), b.data() + 96, b.size() - 96, b.data() + 32) << "\n";
      continue;
    }
    if (mode == "sha512") edgesig::Sha512(b.data(), b.size(), out);
    else edgesig::Blake2b512(b.data(), b.size(), out);
    for (int i = 0; i < 64; ++i) std::printf("%02x", out[i]);
    std::printf("\n");
  }
}
"""


@pytest.fixture(scope="module")
def verifier(tmp_path_factory):
    work = tmp_path_factory.mktemp("signature-h")
    (work / "driver.cc").write_text(DRIVER)
    subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Werror", "-I", str(EDGE), str(work / "driver.cc"),
                    "-o", str(work / "verify")], check=True, capture_output=True)
    return work / "verify"


def lines(verifier, mode, blobs):
    proc = subprocess.run([str(verifier), mode], input="".join(b.hex() + "\n" for b in blobs),
                          capture_output=True, text=True, check=True)
    return proc.stdout.split()


def test_hashes_match_hashlib_across_block_boundaries(verifier):
    rng = random.Random(7)
    messages = [bytes(rng.getrandbits(8) for _ in range(n)) for n in (0, 1, 111, 112, 127, 128, 129, 256, 1000, 5000)]
    assert lines(verifier, "sha512", messages) == [hashlib.sha512(m).hexdigest() for m in messages]
    assert lines(verifier, "blake2b", messages) == [hashlib.blake2b(m).hexdigest() for m in messages]


def test_ed25519_agrees_with_the_python_verifier_on_good_and_damaged_signatures(verifier):
    rng = random.Random(11)
    cases, expected = [], []
    # RFC 8032 section 7.1, test 2 (one byte message)
    rfc_public = bytes.fromhex("3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c")
    rfc_sig = bytes.fromhex("92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da"
                            "085ac1e43e15996e458f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00")
    triples = [(rfc_public, rfc_sig, b"\x72")]
    for i in range(24):
        seed, message = rng.randbytes(32), rng.randbytes(i * 9)
        public, sig = minisign.ed25519_public_key(seed), minisign.ed25519_sign(seed, message)
        flipped = bytearray(sig)
        flipped[i % 64] ^= 1 << (i % 8)
        bad_key = bytearray(public)
        bad_key[i % 32] ^= 2
        big_s = (int.from_bytes(sig[32:], "little") + minisign._L).to_bytes(32, "little")  # s + L: malleated
        triples += [(public, sig, message), (public, bytes(flipped), message), (public, sig, message + b"!"),
                    (bytes(bad_key), sig, message), (public, sig[:32] + big_s, message)]
    for public, sig, message in triples:
        cases.append(public + sig + message)
        expected.append("1" if minisign.ed25519_verify(public, message, sig) else "0")
    assert expected.count("1") == 25  # the RFC vector and every untouched signature
    assert lines(verifier, "ed25519", cases) == expected


@pytest.fixture
def signed(tmp_path):
    pub_text, key_text, key_id = minisign.generate_key_pair("test")
    (tmp_path / "k.pub").write_text(pub_text)
    (tmp_path / "k.key").write_text(key_text)
    sums = tmp_path / "SHA256SUMS"
    sums.write_text("".join(f"{hashlib.sha256(bytes([i])).hexdigest()}  file{i}\n" for i in range(40)))
    (tmp_path / "SHA256SUMS.minisig").write_text(minisign.sign_file(str(sums), str(tmp_path / "k.key"), "package:x"))
    return tmp_path, key_id


def verify(verifier, d, pub="k.pub", sig="SHA256SUMS.minisig"):
    proc = subprocess.run([str(verifier), "verify", str(d / "SHA256SUMS"), str(d / sig), str(d / pub)],
                          capture_output=True, text=True)
    return proc.returncode, proc.stdout.strip()


def test_minisign_files_good_tampered_foreign_and_oversized(verifier, signed, tmp_path):
    d, key_id = signed
    assert verify(verifier, d) == (0, "package:x")
    sums = (d / "SHA256SUMS").read_text()
    (d / "SHA256SUMS").write_text(sums.replace("file3", "file3x"))
    assert verify(verifier, d) == (1, f"{d}/SHA256SUMS.minisig: signature does not match {d}/SHA256SUMS "
                                      "(changed after signing, or not signed with the trusted key)")
    (d / "SHA256SUMS").write_text(sums)
    other_pub, _, other_id = minisign.generate_key_pair("other")
    (d / "other.pub").write_text(other_pub)
    assert verify(verifier, d, pub="other.pub") == (
        1, f"{d}/SHA256SUMS.minisig: signed by key {key_id}, not by the trusted key {other_id} ({d}/other.pub)")
    text = (d / "SHA256SUMS.minisig").read_text().splitlines()
    (d / "edited.minisig").write_text("\n".join([text[0], text[1], text[2] + " edited", text[3]]) + "\n")
    assert verify(verifier, d, sig="edited.minisig") == (1, f"{d}/edited.minisig: trusted comment was changed "
                                                            "after signing")
    (d / "big.minisig").write_bytes(b"A" * (65 << 10))
    assert verify(verifier, d, sig="big.minisig") == (1, f"{d}/big.minisig: larger than 65536 bytes (not a file "
                                                         "this check reads)")
    (d / "junk.minisig").write_text("untrusted comment: x\nnot base64!\n")
    assert verify(verifier, d, sig="junk.minisig") == (1, f"{d}/junk.minisig: not a minisign signature file")


@pytest.mark.skipif(shutil.which("minisign") is None, reason="stock minisign is not installed")
def test_a_stock_minisign_signature_verifies(verifier, tmp_path):
    """Keys and signatures made by the minisign tool itself (installer/bootstrap.sh installs it)."""
    subprocess.run(["minisign", "-G", "-W", "-f", "-p", str(tmp_path / "k.pub"), "-s", str(tmp_path / "k.key")],
                   check=True, capture_output=True)
    (tmp_path / "SHA256SUMS").write_bytes(os.urandom(3000))
    subprocess.run(["minisign", "-S", "-s", str(tmp_path / "k.key"), "-m", str(tmp_path / "SHA256SUMS"),
                    "-t", "stock"], check=True, capture_output=True)
    assert verify(verifier, tmp_path) == (0, "stock")


def odd_variants(d):
    """Signature and key files with a space, a tab or extra carriage returns around a base64 line, and a
    trusted comment holding a character str.splitlines() breaks at: (name of the .minisig, of the .pub)."""
    sig = (d / "SHA256SUMS.minisig").read_text().split("\n")
    pub = (d / "k.pub").read_text().split("\n")
    cases = {}
    for name, lines, which, index, edit in [
            ("sig-leading-space", sig, "sig", 1, lambda s: " " + s), ("sig-trailing-space", sig, "sig", 1, lambda s: s + " "),
            ("sig-tab", sig, "sig", 3, lambda s: "\t" + s), ("global-leading-space", sig, "sig", 3, lambda s: " " + s),
            ("sig-crlf", sig, "sig", 1, lambda s: s + "\r"), ("sig-two-cr", sig, "sig", 1, lambda s: s + "\r\r"),
            ("pub-leading-space", pub, "pub", 1, lambda s: " " + s), ("pub-crlf", pub, "pub", 1, lambda s: s + "\r")]:
        edited = list(lines)
        edited[index] = edit(edited[index])
        (d / f"{name}.{which}").write_text("\n".join(edited))
        cases[name] = (f"{name}.sig", "k.pub") if which == "sig" else ("SHA256SUMS.minisig", f"{name}.pub")
    return cases


def test_the_device_python_and_stock_minisign_agree_on_odd_base64_lines(verifier, signed):
    """issue 43: `bin/run --verify-signature` refused a base64 line with a leading space, the Python
    verifier (str.strip) accepted it. Both now read lines as minisign does (split at LF, one CR before
    it dropped, nothing else), and stock minisign, where installed, gives the same verdicts."""
    d, _ = signed
    verdicts = {}
    for name, (sig, pub) in odd_variants(d).items():
        device = verify(verifier, d, pub=pub, sig=sig)[0] == 0
        try:
            minisign.verify_file(str(d / "SHA256SUMS"), str(d / sig), str(d / pub))
            python = True
        except minisign.SignatureError:
            python = False
        verdicts[name] = (device, python)
        if shutil.which("minisign"):
            stock = subprocess.run(["minisign", "-Vm", str(d / "SHA256SUMS"), "-x", str(d / sig), "-p", str(d / pub)],
                                   capture_output=True).returncode == 0
            verdicts[name] += (stock,)
    accepted = {"sig-crlf", "pub-crlf"}
    for name, said in verdicts.items():
        assert set(said) == {name in accepted}, (name, said)
