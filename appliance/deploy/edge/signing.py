"""The site's edge signing key: `appliance package` signs SHA256SUMS with it, `appliance edge verify`
and the device (install.sh with the installed bin/run) check that signature before anything runs.

The key is a minisign Ed25519 key pair (appliance.core.minisign, so stock `minisign -V` checks a
package too): --key, else $APPLIANCE_EDGE_KEY, else ~/.config/appliance/edge-signing.key
($XDG_CONFIG_HOME respected). The default or $APPLIANCE_EDGE_KEY key is made on first use (mode 0600,
its folder 0700), encrypted when $APPLIANCE_SIGN_PASSPHRASE(_FILE) is set; a --key that does not
exist is an error. The public half sits beside it as .pub: it goes to each device once, and the
package carries a copy (signing-key.pub) only for trust on first use.
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from appliance.core import minisign
from appliance.core.errors import ConfigError, DataError

KEY_ENV = "APPLIANCE_EDGE_KEY"
SIGNATURE = "SHA256SUMS.minisig"
CARRIED_PUB = "signing-key.pub"
MAX_SIGNATURE_BYTES = 64 << 10


def default_key_path() -> Path:
    if os.environ.get(KEY_ENV):
        return Path(os.environ[KEY_ENV])
    config = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(config) / "appliance" / "edge-signing.key"


def public_path(key: Path) -> Path:
    return key.with_suffix(".pub") if key.suffix == ".key" else key.with_name(key.name + ".pub")


def site_key(key=None) -> tuple[Path, Path, str, bool]:
    """(secret key, public key, key id, made now) for signing; makes the default key on first use."""
    explicit = key is not None
    key = Path(key) if explicit else default_key_path()
    made = False
    if not os.path.lexists(key):
        if explicit:
            raise ConfigError(f"{key}: no such signing key (leave --key out to use, or make, the site key "
                              f"{default_key_path()})")
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        base = str(key)[:-4] if key.suffix == ".key" else str(key)
        made_key, _, _ = minisign.write_key_pair(base, "appliance package (edge signing key)",
                                                 minisign.passphrase_from_env())
        if Path(made_key) != key:
            os.replace(made_key, key)
            os.replace(f"{base}.pub", public_path(key))
        made = True
    info = os.stat(key)  # follows a link: the key's own mode is what matters
    if not stat.S_ISREG(info.st_mode):
        raise ConfigError(f"{key}: not a regular file (an edge signing key)")
    if info.st_mode & 0o077:
        raise ConfigError(f"{key}: readable by others (mode {stat.S_IMODE(info.st_mode):04o}); chmod 600 it, "
                          "and make a new key if others may have copied it")
    key_id, seed = minisign.read_secret_key(str(key))
    pub = public_path(key)
    public = minisign.ed25519_public_key(seed)
    if not pub.is_file() or minisign.read_public_key(str(pub)) != (key_id, public):
        raise ConfigError(f"{pub}: missing or not the public half of {key}")
    return key, pub, minisign.key_id_text(key_id), made


def sign_sums(root: Path, key: Path, comment: str) -> None:
    """root/SHA256SUMS.minisig: a prehashed minisign signature of root/SHA256SUMS."""
    trusted = f"timestamp:{int(time.time())}\tfile:SHA256SUMS\t{comment}"
    (root / SIGNATURE).write_text(minisign.sign_file(str(root / "SHA256SUMS"), str(key), trusted))


def trusted_key(pubkey=None) -> Path:
    """The public key edge verify trusts: --pubkey, else the site key's .pub."""
    if pubkey is not None:
        if not Path(pubkey).is_file():
            raise ConfigError(f"{pubkey}: " + ("not a regular file (a device, pipe or folder), so not a public key"
                                               if os.path.exists(pubkey) else "no such public key file"))
        return Path(pubkey)
    pub = public_path(default_key_path())
    if not pub.is_file():
        raise ConfigError(f"{pub}: no site public key to check the signature with: pass --pubkey KEY.pub "
                          f"(or set {KEY_ENV} to the site's signing key)")
    return pub


def check_signature(root: Path, package: Path, pubkey: Path) -> str:
    """The signature of root/SHA256SUMS with pubkey, before anything else of the package is read;
    returns the trusted comment. One line naming the package on any failure."""
    sig = root / SIGNATURE
    if not sig.is_file():
        raise DataError(f"{package}: not signed (no edge-package/{SIGNATURE}); refused: package it again "
                        "with `appliance package`, which signs with the site key")
    if sig.stat().st_size > MAX_SIGNATURE_BYTES:
        raise DataError(f"{package}: edge-package/{SIGNATURE} is {sig.stat().st_size} bytes, not a signature")
    try:
        return minisign.verify_file(str(root / "SHA256SUMS"), str(sig), str(pubkey))
    except minisign.SignatureError as err:
        what = str(err).replace(str(sig), f"edge-package/{SIGNATURE}")
        raise DataError(f"{package}: {what}; refused") from None
