"""Ed25519 signatures in minisign's file formats.

Two sides, one file:
- verifying (the air-gapped side) is pure-Python standard library: the offline installer must
  check a bundle before anything is installed, with nothing but the target's python3 (>= 3.10).
  This file is therefore copied into every bundle (`installer/minisign.py`) and needs nothing
  outside the standard library to verify. Ed25519 verification follows RFC 8032 section 6
  (extended coordinates); it handles only public data, so its timing does not matter.
- signing and key generation use the maintained, constant-time Ed25519 of the `cryptography`
  package where it is installed (the connected host: manifests/dev.lock), imported only there;
  a site without it (which signs its edge packages, appliance.deploy.edge.signing) falls back to
  RFC 8032 signing here, with a Montgomery ladder (no branch on the secret).
Both are tested against RFC 8032's vectors and the stock `minisign` tool (tests/bundle/test_minisign.py).

minisign formats (https://jedisct1.github.io/minisign/), all base64 lines after a comment:
  public key   "Ed" | key id (8) | public key (32)
  secret key   "Ed" | kdf "\\0\\0" (unencrypted) or "Sc" (scrypt) | "B2" | salt (32) | opslimit (8)
               | memlimit (8) | key id (8) | secret key: seed + public (64) | blake2b-256 checksum (32)
               With "Sc", the last 104 bytes are xored with scrypt(passphrase, salt) as libsodium's
               crypto_pwhash_scryptsalsa208sha256 derives it from opslimit and memlimit.
  signature    "ED" | key id (8) | ed25519(blake2b-512(file)) (64), then a trusted comment
               line and ed25519(signature (64) + trusted comment) (64). Legacy "Ed" signatures
               (minisign -l, over the raw file) are refused: a bundle is too big to hold in memory.
"""

from __future__ import annotations

import base64
import hashlib
import os
import stat
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


def _decompress(s: bytes):
    y = int.from_bytes(s, "little")
    sign, y = y >> 255, y & ((1 << 255) - 1)
    x = _recover_x(y, sign)
    return None if x is None else (x, y, 1, x * y % _P)


def _hash_int(data: bytes) -> int:
    return int.from_bytes(hashlib.sha512(data).digest(), "little") % _L


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


# --- signing ------------------------------------------------------------------------------


def _private_key(seed: bytes):
    """cryptography's Ed25519 key (constant time, OpenSSL), or None where the package is absent."""
    # Imported here, not at the top: this file also runs on the air-gapped host with only the
    # standard library, where it verifies bundles.
    try:
        from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    except ImportError:
        return None
    return Ed25519PrivateKey.from_private_bytes(seed)


def _expand(seed: bytes) -> tuple[int, bytes]:
    """RFC 8032 5.1.5: the clamped secret scalar and the nonce prefix."""
    h = hashlib.sha512(seed).digest()
    a = int.from_bytes(h[:32], "little")
    a = (a & ~7 & ((1 << 254) - 1)) | (1 << 254)
    return a, h[32:]


def _ladder(s: int, P):
    """s * P with the same sequence of point operations for every s of 255 bits (a Montgomery
    ladder): signing without `cryptography` leaks no branch on the secret scalar. Python's integers
    are not constant time, so this is the fallback, not the preferred path."""
    R0, R1 = (0, 1, 1, 0), P
    for i in range(254, -1, -1):
        bit = (s >> i) & 1
        pair = (R0, R1) if bit == 0 else (R1, R0)
        low, high = _add(pair[0], pair[1]), _add(pair[0], pair[0])
        R0, R1 = (high, low) if bit == 0 else (low, high)
    return R0


def _compress(P) -> bytes:
    zi = pow(P[2], _P - 2, _P)
    x, y = P[0] * zi % _P, P[1] * zi % _P
    return (y | ((x & 1) << 255)).to_bytes(32, "little")


def ed25519_public_key(seed: bytes) -> bytes:
    key = _private_key(seed)
    if key is not None:
        return key.public_key().public_bytes_raw()
    return _compress(_ladder(_expand(seed)[0], _G))


def ed25519_sign(seed: bytes, message: bytes) -> bytes:
    """Constant-time Ed25519 of `cryptography` (OpenSSL) where it is installed (the connected host:
    manifests/dev.lock), else RFC 8032 5.1.6 here, for a site that signs its edge packages offline."""
    key = _private_key(seed)
    if key is not None:
        return key.sign(message)
    a, prefix = _expand(seed)
    public = _compress(_ladder(a, _G))
    r = _hash_int(prefix + message)
    R = _compress(_ladder(r, _G))
    s = (r + _hash_int(R + public + message) * a) % _L
    return R + s.to_bytes(32, "little")


# --- minisign files -----------------------------------------------------------------------


try:  # in the appliance package a bad key is a user error (one line, exit 2), never "internal error"
    from appliance.core.errors import ApplianceError as _ErrorBase
except ImportError:  # copied into a bundle, on the air-gapped host: standard library only
    _ErrorBase = Exception


class SignatureError(_ErrorBase):
    """A key, passphrase or signature file is unusable, or a signature does not verify (one line)."""


def key_id_text(key_id: bytes) -> str:
    """minisign prints the 8-byte key id as a little-endian number in hex."""
    return int.from_bytes(key_id, "little").to_bytes(8, "big").hex().upper()


def minisign_lines(text: str) -> list[str]:
    """A key or signature file's lines as minisign 0.11 reads them: split at LF only, never at the
    other breaks str.splitlines() knows (a trusted comment may hold \x1c), one CR before the LF
    dropped and nothing else trimmed, so a base64 line with a space before or after it (or "\r\r") is
    refused here as by minisign and by the device's bin/run --verify-signature (edge/signature.h)."""
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _b64_line(text: str, what: str, length: int) -> bytes:
    try:
        raw = base64.b64decode(text, validate=True)
    except ValueError:
        raise SignatureError(f"{what}: not base64") from None
    if len(raw) != length:
        raise SignatureError(f"{what}: {len(raw)} bytes where minisign has {length}")
    return raw


MAX_KEY_FILE_BYTES = 64 << 10  # a .pub, .key or .minisig is a few hundred bytes (a trusted comment is one line)


def read_small_text(path: str, what: str, limit: int = MAX_KEY_FILE_BYTES) -> str:
    """A key or signature file as UTF-8 text, read no further than limit bytes: a link to /dev/zero
    or a 200 MB "signature" is refused, not read whole. FileNotFoundError passes through."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a device, pipe or socket"
            raise SignatureError(f"{path}: is {kind}, not a {what}")
        data = os.read(fd, limit + 1)
        while len(data) <= limit and (block := os.read(fd, limit + 1 - len(data))):
            data += block
    finally:
        os.close(fd)
    if len(data) > limit:
        raise SignatureError(f"{path}: more than {limit // 1024} KiB, too large for a {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise SignatureError(f"{path}: not a {what} (byte {err.start} is not UTF-8 text)") from None
MAX_SMALL_FILE = 64 << 10  # keys, signatures, passphrases: a few hundred bytes each


def _read_small(path: str) -> bytes:
    """A key, signature or passphrase file, refused past MAX_SMALL_FILE (a link to /dev/zero, a huge file)."""
    with open(path, "rb") as f:
        data = f.read(MAX_SMALL_FILE + 1)
    if len(data) > MAX_SMALL_FILE:
        raise SignatureError(f"{path}: larger than {MAX_SMALL_FILE} bytes, not a minisign key or signature file")
    return data


def read_public_key(path_or_text: str) -> tuple[bytes, bytes]:
    """(key id, public key) from a minisign .pub file, or from its base64 line (like `minisign -P`)."""
    if os.path.exists(path_or_text):
        try:
            text = read_small_text(path_or_text, "minisign public key")
        except OSError as err:
            raise SignatureError(f"{path_or_text}: unreadable ({err.strerror or err})") from None
        lines = minisign_lines(text)
        what = path_or_text
        line = lines[-1] if lines else ""
    else:
        what, line = "public key", path_or_text
    raw = _b64_line(line, what, 42)
    if raw[:2] != b"Ed":
        raise SignatureError(f"{what}: not an Ed25519 minisign public key")
    return raw[2:10], raw[10:]


PASSPHRASE_ENV = "APPLIANCE_SIGN_PASSPHRASE"
PASSPHRASE_FILE_ENV = "APPLIANCE_SIGN_PASSPHRASE_FILE"
# What stock `minisign -G` writes (libsodium's *_SENSITIVE limits): scrypt N=2^20, r=8, p=1, 1 GiB.
OPSLIMIT, MEMLIMIT = 33554432, 1073741824
_streams: dict[bytes, bytes] = {}
_SECRET_LEN = 104  # key id (8) + seed and public key (64) + checksum (32): the part scrypt encrypts


def read_passphrase_file(path: str) -> str:
    """The first line of a passphrase file (without its line end)."""
    try:
        text = _read_small(path).decode("utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise SignatureError(f"{path}: passphrase file unreadable ({getattr(err, 'strerror', None) or err})") \
            from None
    passphrase = text.splitlines()[0] if text else ""
    if not passphrase:
        raise SignatureError(f"{path}: passphrase file is empty")
    return passphrase


def passphrase_from_env() -> str | None:
    """$APPLIANCE_SIGN_PASSPHRASE_FILE (a file whose first line is it) or $APPLIANCE_SIGN_PASSPHRASE."""
    if os.environ.get(PASSPHRASE_FILE_ENV):
        return read_passphrase_file(os.environ[PASSPHRASE_FILE_ENV])
    return os.environ.get(PASSPHRASE_ENV) or None


def _scrypt_params(opslimit: int, memlimit: int) -> tuple[int, int, int]:
    """(N, r, p) from libsodium's opslimit/memlimit, as crypto_pwhash_scryptsalsa208sha256 picks them."""
    def log2_n(max_n: int) -> int:  # the smallest n with 2**n > max_n / 2
        n = 1
        while n < 63 and (1 << n) <= max_n // 2:
            n += 1
        return n

    opslimit, r = max(opslimit, 32768), 8
    if opslimit < memlimit // 32:
        n, p = log2_n(opslimit // (r * 4)), 1
    else:
        n = log2_n(memlimit // (r * 128))
        p = min((opslimit // 4) >> n, 0x3FFFFFFF) // r
    return 1 << n, r, p


def _key_stream(passphrase: str, salt: bytes, opslimit: int, memlimit: int, what: str) -> bytes:
    n, r, p = _scrypt_params(opslimit, memlimit)
    maxmem = 128 * r * (n + p + 2) + (1 << 20)
    if maxmem > 2**31 - 1 or p < 1:  # hashlib (OpenSSL) takes at most 2 GiB; minisign's default is 1 GiB
        raise SignatureError(f"{what}: scrypt parameters out of range (N={n}, r={r}, p={p})")
    return hashlib.scrypt(passphrase.encode("utf-8"), salt=salt, n=n, r=r, p=p, dklen=_SECRET_LEN, maxmem=maxmem)


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b))


def read_secret_key(path: str, passphrase: str | None = None) -> tuple[bytes, bytes]:
    """(key id, 32-byte seed) from a minisign secret key file, unencrypted or passphrase-protected.

    For a protected key the passphrase is the argument, else passphrase_from_env().
    """
    try:
        lines = [ln for ln in _read_small(path).decode("utf-8").splitlines() if ln.strip()]
    except FileNotFoundError:
        raise SignatureError(f"{path}: secret key file missing") from None
    except (OSError, UnicodeDecodeError) as err:
        raise SignatureError(f"{path}: unreadable ({err})") from None
    raw = _b64_line(lines[-1] if lines else "", path, 158)
    if raw[:2] != b"Ed" or raw[4:6] != b"B2":
        raise SignatureError(f"{path}: not an Ed25519 minisign secret key")
    kdf, secret_part = raw[2:4], raw[54:158]
    if kdf == b"Sc":
        passphrase = passphrase or passphrase_from_env()
        if not passphrase:
            raise SignatureError(f"{path}: passphrase-protected key: set {PASSPHRASE_ENV}, or {PASSPHRASE_FILE_ENV} "
                                 "to a file holding the passphrase")
        salt = raw[6:38]
        opslimit, memlimit = int.from_bytes(raw[38:46], "little"), int.from_bytes(raw[46:54], "little")
        # scrypt with minisign's limits takes seconds and 1 GiB: derive once per key and process
        # (bundle build checks the key before its downloads, then signs with it).
        cache_key = hashlib.sha256(raw + b"\0" + passphrase.encode("utf-8")).digest()
        if cache_key not in _streams:
            _streams[cache_key] = _key_stream(passphrase, salt, opslimit, memlimit, path)
        secret_part = _xor(secret_part, _streams[cache_key])
    elif kdf != b"\0\0":
        raise SignatureError(f"{path}: unknown key derivation {kdf!r} (minisign knows scrypt and none)")
    key_id, secret, checksum = secret_part[:8], secret_part[8:72], secret_part[72:]
    # minisign -W leaves the checksum zero; ours and every encrypted key carry blake2b-256 of alg | id | secret.
    if (kdf == b"Sc" or any(checksum)) and checksum != _checksum(key_id, secret):
        if kdf == b"Sc":
            raise SignatureError(f"{path}: wrong passphrase (or a damaged key file)")
        raise SignatureError(f"{path}: checksum mismatch (damaged key file)")
    seed, public = secret[:32], secret[32:]
    if ed25519_public_key(seed) != public:
        raise SignatureError(f"{path}: secret and public halves do not match (damaged key file)")
    return key_id, seed


def _checksum(key_id: bytes, secret: bytes) -> bytes:
    return hashlib.blake2b(b"Ed" + key_id + secret, digest_size=32).digest()


def generate_key_pair(made_by: str, passphrase: str | None = None) -> tuple[str, str, str]:
    """A new key pair: (public key file text, secret key file text, key id).

    With a passphrase the secret key is encrypted as `minisign -G` does it, so stock minisign uses it.
    """
    seed, key_id = os.urandom(32), os.urandom(8)
    public = ed25519_public_key(seed)
    secret = seed + public
    secret_part = key_id + secret + _checksum(key_id, secret)
    if passphrase:
        salt = os.urandom(32)
        header = b"Ed" + b"Sc" + b"B2" + salt + OPSLIMIT.to_bytes(8, "little") + MEMLIMIT.to_bytes(8, "little")
        secret_part = _xor(secret_part, _key_stream(passphrase, salt, OPSLIMIT, MEMLIMIT, "new key"))
        kind = "encrypted"
    else:
        header, kind = b"Ed" + b"\0\0" + b"B2" + bytes(32 + 8 + 8), "unencrypted"
    kid = key_id_text(key_id)
    pub_text = (f"untrusted comment: minisign public key {kid}\n"
                f"{base64.b64encode(b'Ed' + key_id + public).decode()}\n")
    sec_text = (f"untrusted comment: minisign {kind} secret key {kid} (made by {made_by})\n"
                f"{base64.b64encode(header + secret_part).decode()}\n")
    return pub_text, sec_text, kid


def write_key_pair(out: str, made_by: str, passphrase: str | None = None, force: bool = False
                   ) -> tuple[str, str, str]:
    """Write OUT.key (mode 0600 from its first byte) and OUT.pub; return (key path, pub path, key id)."""
    key, pub = f"{out}.key", f"{out}.pub"
    for path in (pub, key):
        if os.path.lexists(path) and not force:
            raise SignatureError(f"{path}: exists; refusing to overwrite a key (pass --force)")
    pub_text, key_text, key_id = generate_key_pair(made_by, passphrase)
    os.makedirs(os.path.dirname(os.path.abspath(key)), exist_ok=True)
    for path, text, mode in ((key, key_text, 0o600), (pub, pub_text, 0o644)):
        tmp = f"{path}.tmp-{os.getpid()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)  # a forced overwrite never keeps an old file's wider mode
    return key, pub, key_id


def file_digest(path: str) -> bytes:
    """blake2b-512 of a file (minisign's prehash)."""
    h = hashlib.blake2b(digest_size=64)
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.digest()


def sign_file(path: str, secret_key_path: str, trusted_comment: str | None = None,
              passphrase: str | None = None) -> str:
    """The text of a minisign signature (prehashed, "ED") of the file at path."""
    key_id, seed = read_secret_key(secret_key_path, passphrase)
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
        lines = minisign_lines(read_small_text(signature_path, "minisign signature"))
    except FileNotFoundError:
        raise SignatureError(f"{signature_path}: signature file missing") from None
    except OSError as err:
        raise SignatureError(f"{signature_path}: unreadable ({err.strerror or err})") from None
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
