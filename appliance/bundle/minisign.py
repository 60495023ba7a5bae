"""Ed25519 signatures in minisign's file formats, in pure-Python standard library.

Why pure Python: the offline installer must verify a bundle before anything is installed,
with nothing but the target's python3 (>= 3.10). This file is therefore copied into every
bundle (`installer/minisign.py`) and imports nothing outside the standard library. The same
code signs on the build host, so one implementation is tested both ways, against RFC 8032's
test vectors and against the stock `minisign` tool (tests/bundle/test_minisign.py).

Ed25519 follows RFC 8032 section 6 (the reference implementation, extended coordinates).
Verification handles only public data, so timing does not matter there. Signing uses Python
integers, which are not constant time: fine for a one-shot CLI on the build host, never
expose `sign` as a service.

minisign formats (https://jedisct1.github.io/minisign/), all base64 lines after a comment:
  public key   "Ed" | key id (8) | public key (32)
  secret key   "Ed" | kdf "\\0\\0" (unencrypted) | "B2" | salt (32) | opslimit (8) | memlimit (8)
               | key id (8) | secret key: seed + public (64) | blake2b-256 checksum (32)
  signature    "ED" | key id (8) | ed25519(blake2b-512(file)) (64), then a trusted comment
               line and ed25519(signature (64) + trusted comment) (64). Legacy "Ed" signatures
               (minisign -l, over the raw file) are refused: a bundle is too big to hold in memory.
"""

from __future__ import annotations

import base64
import hashlib
import os
import time

# --- Ed25519 (RFC 8032, section 6) -------------------------------------------------------

_P = 2**255 - 19
_L = 2**252 + 27742317777372353535851937790883648493  # order of the base point
_D = -121665 * pow(121666, _P - 2, _P) % _P
_SQRT_M1 = pow(2, (_P - 1) // 4, _P)


def _add(P, Q):
    A = (P[1] - P[0]) * (Q[1] - Q[0]) % _P
    B = (P[1] + P[0]) * (Q[1] + Q[0]) % _P
    C = 2 * P[3] * Q[3] * _D % _P
    D = 2 * P[2] * Q[2] % _P
    E, F, G, H = B - A, D - C, D + C, B + A
    return (E * F % _P, G * H % _P, F * G % _P, E * H % _P)


def _mul(s: int, P):
    Q = (0, 1, 1, 0)  # the neutral element
    while s > 0:
        if s & 1:
            Q = _add(Q, P)
        P = _add(P, P)
        s >>= 1
    return Q


def _equal(P, Q) -> bool:
    return (P[0] * Q[2] - Q[0] * P[2]) % _P == 0 and (P[1] * Q[2] - Q[1] * P[2]) % _P == 0


def _recover_x(y: int, sign: int):
    if y >= _P:
        return None  # non-canonical encoding
    x2 = (y * y - 1) * pow(_D * y * y + 1, _P - 2, _P)
    if x2 % _P == 0:
        return None if sign else 0
    x = pow(x2, (_P + 3) // 8, _P)
    if (x * x - x2) % _P != 0:
        x = x * _SQRT_M1 % _P
    if (x * x - x2) % _P != 0:
        return None
    if (x & 1) != sign:
        x = _P - x
    return x


_GY = 4 * pow(5, _P - 2, _P) % _P
_GX = _recover_x(_GY, 0)
_G = (_GX, _GY, 1, _GX * _GY % _P)


def _compress(P) -> bytes:
    zinv = pow(P[2], _P - 2, _P)
    x, y = P[0] * zinv % _P, P[1] * zinv % _P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def _decompress(s: bytes):
    y = int.from_bytes(s, "little")
    sign, y = y >> 255, y & ((1 << 255) - 1)
    x = _recover_x(y, sign)
    return None if x is None else (x, y, 1, x * y % _P)


def _hash_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha512(data).digest(), "little") % _L


def _expand(seed: bytes) -> tuple[int, bytes]:
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little")
    a &= (1 << 254) - 8
    a |= 1 << 254
    return a, h[32:]


def ed25519_public_key(seed: bytes) -> bytes:
    a, _ = _expand(seed)
    return _compress(_mul(a, _G))


def ed25519_sign(seed: bytes, message: bytes) -> bytes:
    a, prefix = _expand(seed)
    public = _compress(_mul(a, _G))
    r = _hash_int(prefix + message)
    R = _compress(_mul(r, _G))
    s = (r + _hash_int(R + public + message) * a) % _L
    return R + s.to_bytes(32, "little")


def ed25519_verify(public: bytes, message: bytes, signature: bytes) -> bool:
    if len(public) != 32 or len(signature) != 64:
        return False
    A = _decompress(public)
    R = _decompress(signature[:32])
    s = int.from_bytes(signature[32:], "little")
    if A is None or R is None or s >= _L:
        return False
    h = _hash_int(signature[:32] + public + message)
    return _equal(_mul(s, _G), _add(R, _mul(h, A)))


# --- minisign files -----------------------------------------------------------------------


class SignatureError(Exception):
    """A key or signature file is malformed, or a signature does not verify (one line)."""


def key_id_text(key_id: bytes) -> str:
    """minisign prints the 8-byte key id as a little-endian number in hex."""
    return int.from_bytes(key_id, "little").to_bytes(8, "big").hex().upper()


def _b64_line(text: str, what: str, length: int) -> bytes:
    try:
        raw = base64.b64decode(text.strip(), validate=True)
    except ValueError:
        raise SignatureError(f"{what}: not base64") from None
    if len(raw) != length:
        raise SignatureError(f"{what}: {len(raw)} bytes where minisign has {length}")
    return raw


def read_public_key(path_or_text: str) -> tuple[bytes, bytes]:
    """(key id, public key) from a minisign .pub file, or from its base64 line (like `minisign -P`)."""
    if os.path.exists(path_or_text):
        with open(path_or_text, encoding="utf-8") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
        what = path_or_text
        line = lines[-1] if lines else ""
    else:
        what, line = "public key", path_or_text
    raw = _b64_line(line, what, 42)
    if raw[:2] != b"Ed":
        raise SignatureError(f"{what}: not an Ed25519 minisign public key")
    return raw[2:10], raw[10:]


def read_secret_key(path: str) -> tuple[bytes, bytes]:
    """(key id, 32-byte seed) from an unencrypted minisign secret key file."""
    with open(path, encoding="utf-8") as f:
        lines = [ln for ln in f.read().splitlines() if ln.strip()]
    raw = _b64_line(lines[-1] if lines else "", path, 158)
    if raw[:2] != b"Ed" or raw[4:6] != b"B2":
        raise SignatureError(f"{path}: not an Ed25519 minisign secret key")
    if raw[2:4] != b"\0\0":
        raise SignatureError(f"{path}: password-protected key; use one from `appliance bundle keygen` "
                             "or `minisign -G -W`")
    key_id, secret, checksum = raw[54:62], raw[62:126], raw[126:158]
    # minisign -W leaves the checksum zero; ours is the real blake2b-256 of alg | id | secret.
    if any(checksum) and checksum != hashlib.blake2b(raw[:2] + key_id + secret, digest_size=32).digest():
        raise SignatureError(f"{path}: checksum mismatch (damaged key file)")
    seed, public = secret[:32], secret[32:]
    if ed25519_public_key(seed) != public:
        raise SignatureError(f"{path}: secret and public halves do not match (damaged key file)")
    return key_id, seed


def generate_key_pair(made_by: str) -> tuple[str, str, str]:
    """A new key pair: (public key file text, secret key file text, key id)."""
    seed, key_id = os.urandom(32), os.urandom(8)
    public = ed25519_public_key(seed)
    secret = seed + public
    checksum = hashlib.blake2b(b"Ed" + key_id + secret, digest_size=32).digest()
    raw_secret = b"Ed" + b"\0\0" + b"B2" + bytes(32 + 8 + 8) + key_id + secret + checksum
    kid = key_id_text(key_id)
    pub_text = (f"untrusted comment: minisign public key {kid}\n"
                f"{base64.b64encode(b'Ed' + key_id + public).decode()}\n")
    sec_text = (f"untrusted comment: minisign secret key {kid} (unencrypted; made by {made_by})\n"
                f"{base64.b64encode(raw_secret).decode()}\n")
    return pub_text, sec_text, kid


def file_digest(path: str) -> bytes:
    """blake2b-512 of a file (minisign's prehash)."""
    h = hashlib.blake2b(digest_size=64)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.digest()


def sign_file(path: str, secret_key_path: str, trusted_comment: str | None = None) -> str:
    """The text of a minisign signature (prehashed, "ED") of the file at path."""
    key_id, seed = read_secret_key(secret_key_path)
    if trusted_comment is None:
        trusted_comment = f"timestamp:{int(time.time())}\tfile:{os.path.basename(path)}\thashed"
    if "\n" in trusted_comment or "\r" in trusted_comment:
        raise SignatureError("trusted comment must be one line")
    signature = ed25519_sign(seed, file_digest(path))
    global_signature = ed25519_sign(seed, signature + trusted_comment.encode())
    return (f"untrusted comment: signature from minisign secret key {key_id_text(key_id)}\n"
            f"{base64.b64encode(b'ED' + key_id + signature).decode()}\n"
            f"trusted comment: {trusted_comment}\n"
            f"{base64.b64encode(global_signature).decode()}\n")


def verify_file(path: str, signature_path: str, public_key: str) -> str:
    """Check a minisign signature of the file at path; return its trusted comment.

    public_key is a .pub file or its base64 line. Raises SignatureError with one line.
    """
    return verify_digest(file_digest(path), os.path.basename(path), signature_path, public_key)


def verify_digest(digest: bytes, file_name: str, signature_path: str, public_key: str) -> str:
    """verify_file for a file whose blake2b-512 the caller computed (e.g. while copying it, so that
    the bytes checked are the bytes used); file_name only names it in errors."""
    key_id, public = read_public_key(public_key)
    try:
        with open(signature_path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        raise SignatureError(f"{signature_path}: signature file missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SignatureError(f"{signature_path}: unreadable ({err})") from None
    if len(lines) < 4 or not lines[2].startswith("trusted comment: "):
        raise SignatureError(f"{signature_path}: not a minisign signature file")
    raw = _b64_line(lines[1], signature_path, 74)
    algorithm, sig_key_id, signature = raw[:2], raw[2:10], raw[10:]
    if sig_key_id != key_id:
        raise SignatureError(f"{signature_path}: signed by key {key_id_text(sig_key_id)}, "
                             f"not by the trusted key {key_id_text(key_id)}")
    if algorithm == b"Ed":  # minisign -l: the whole file is the message, too big to hold for a bundle
        raise SignatureError(f"{signature_path}: legacy (not prehashed) signature; sign without minisign -l")
    if algorithm != b"ED":
        raise SignatureError(f"{signature_path}: unknown signature algorithm {algorithm!r}")
    if not ed25519_verify(public, digest, signature):
        raise SignatureError(f"{signature_path}: signature does not match {file_name} "
                             "(the file was changed after signing, or the signature is damaged)")
    trusted_comment = lines[2][len("trusted comment: "):]
    global_signature = _b64_line(lines[3], signature_path, 64)
    if not ed25519_verify(public, signature + trusted_comment.encode(), global_signature):
        raise SignatureError(f"{signature_path}: trusted comment was changed after signing")
    return trusted_comment
