"""`appliance bundle build`, `audit`, `keygen` and `image` (argument parsing only)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from appliance.bundle.weights import MIRROR_ENV, parse_names
from appliance.bundle.audit import audit as audit_bundle
from appliance.bundle.image import build_image
from appliance import __version__
from appliance.core import minisign, values
from appliance.core.errors import ConfigError
from appliance.core.values import output_file


def _build(args) -> int:
    from appliance.bundle.build import build_bundle, default_source  # late: importlib.metadata, a tenth of --help

    source = Path(args.source) if args.source else default_source()
    tar = build_bundle(args.profile, Path(args.out), source, Path(args.sign_key) if args.sign_key else None,
                       Path(args.cache), args.vulnerability_data, parse_names(",".join(args.weights or [])),
                       args.weights_mirror or os.environ.get(MIRROR_ENV) or None, tuning_dbs=args.tuning_db or ())
    print(tar)
    return 0


def _audit(args) -> int:
    result = audit_bundle(Path(args.bundle))
    print(f"{args.bundle}:")
    for line in result.lines:
        print(f"  {line}")
    return 1 if result.findings else 0


def _image(args) -> int:
    opt = {k: Path(getattr(args, k)) if getattr(args, k) else None
           for k in ("base_oci", "base_root", "base_debs", "bundle", "sbom")}
    digest = build_image(Path(args.out), Path(args.env), **opt)
    print(f"{args.out} {digest}")
    return 0


def _keygen(args) -> int:
    passphrase = None
    if args.passphrase_file:
        passphrase = minisign.read_passphrase_file(args.passphrase_file)
    elif args.encrypt:
        passphrase = minisign.passphrase_from_env() or _ask_passphrase()
        if passphrase is None:
            raise ConfigError(f"--encrypt: no passphrase: set {minisign.PASSPHRASE_ENV} or "
                              f"{minisign.PASSPHRASE_FILE_ENV}, pass --passphrase-file, or run on a terminal")
    key, pub, key_id = minisign.write_key_pair(args.out, f"appliance bundle keygen {__version__}", passphrase,
                                               args.force)
    print(f"key id {key_id}: secret key {key} ({'encrypted' if passphrase else 'unencrypted'}; keep it on the "
          f"build host), public key {pub} (give it to sites: install.sh --pubkey, or minisign -V -p)",
          file=sys.stderr)
    return 0


def key_prefix(text: str) -> str:
    """keygen --out PREFIX: PREFIX.key and PREFIX.pub are files we can write, checked at parse time as
    every --out FILE is (a directory, a device or an unwritable place is one line, before a key is made)."""
    import argparse

    if not text or text.endswith(("/", os.sep)) or os.path.basename(text) in (".", ".."):
        raise argparse.ArgumentTypeError(f"{text!r} is not a path prefix: give e.g. keys/site for keys/site.key "
                                         "and keys/site.pub")
    for suffix in (".key", ".pub"):
        values.output_file(text + suffix)
    return text


def _ask_passphrase() -> str | None:
    import getpass

    if not sys.stdin.isatty():
        return None
    first = getpass.getpass("passphrase for the new secret key: ")
    if not first:
        raise ConfigError("--encrypt: empty passphrase")
    if getpass.getpass("the same passphrase again: ") != first:
        raise ConfigError("--encrypt: the two passphrases differ")
    return first


def register(subparsers) -> None:
    bundle = subparsers.add_parser("bundle", help="build the signed, offline bundle that crosses the air gap",
                                   description="Build appliance-bundle-<version>.tar from the hash-pinned "
                                   "profiles in manifests/ (run on a connected host).")
    verbs = bundle.add_subparsers(dest="bundle_verb", metavar="VERB", required=True)

    build = verbs.add_parser("build", help="download the locked wheels and write the bundle tar",
                             description="Download exactly the locked wheels of each profile and Python it "
                             "serves (binary only, sha256 checked), add this project's wheel, SHA256SUMS, a "
                             "CycloneDX SBOM per profile and Python, and bundle.json, write "
                             "appliance-bundle-<version>.tar into --out and sign it (minisign format) with "
                             "--sign-key. Wheels are fetched with `pip download`, so pip's index, proxy, "
                             "certificate and netrc settings apply.")
    build.add_argument("--profile", action="append", required=True,
                       help="profile from manifests/profiles.toml (repeat for several)")
    build.add_argument("--out", required=True, type=values.output_dir, help="output directory")
    build.add_argument("--sign-key", help="minisign secret key (from `appliance bundle keygen`)")
    build.add_argument("--source", help="source checkout holding manifests/ and installer/ "
                       "(default: the one this appliance runs from)")
    build.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "appliance", "wheels"),
                       help="download directory pip reuses (default: %(default)s)")
    build.add_argument("--vulnerability-data", metavar="URL",
                       help="base of the PyPI-style JSON API whose `vulnerabilities` field the SBOM records "
                       "(default: beside the index, e.g. https://pypi.org/pypi for https://pypi.org/simple)")
    build.add_argument("--weights", action="append", metavar="NAME,...",
                       help="torchvision models whose published pretrained weights the bundle carries, e.g. "
                       "resnet18,mobilenet_v2 (NAME:ENTRY for another entry than DEFAULT, e.g. "
                       "resnet50:IMAGENET1K_V2); URL and hash from torchvision's weights registry, checked "
                       "after download, cached in CACHE/weights")
    build.add_argument("--weights-mirror", metavar="URL",
                       help="fetch the weights from this mirror of https://download.pytorch.org instead "
                       "(the published path is kept: URL/models/resnet18-f37072fd.pth; default "
                       "$APPLIANCE_WEIGHTS_MIRROR)")
    build.add_argument("--tuning-db", action="append", metavar="DIR",
                       help="tuning database made by `appliance compile --tune` to carry (repeat for several); "
                       "installed next to the venv, where `appliance compile` applies it to matching kernels")
    build.set_defaults(func=_build)

    audit = verbs.add_parser("audit", help="print the known vulnerabilities recorded in a bundle (offline)",
                             description="Print, per profile and Python, the known vulnerabilities of the "
                             "bundle's pinned packages as recorded in its SBOMs at build time, with where and "
                             "when that data was taken. Reads only the bundle. Exit 1 when any are listed.")
    audit.add_argument("bundle", help="appliance-bundle-<version>.tar")
    audit.set_defaults(func=_audit)

    keygen = verbs.add_parser("keygen", help="make an Ed25519 signing key pair (minisign format)",
                              description="Write PREFIX.key (secret, mode 0600) and PREFIX.pub. With --encrypt "
                              "the secret key is protected by a passphrase in minisign's own format (scrypt), "
                              "so stock `minisign -S` uses it too; `bundle build` then reads the passphrase "
                              "from $APPLIANCE_SIGN_PASSPHRASE or the file named by "
                              "$APPLIANCE_SIGN_PASSPHRASE_FILE.")
    keygen.add_argument("--out", required=True, type=key_prefix, help="path prefix of the key files (PREFIX.key, PREFIX.pub)")
    keygen.add_argument("--encrypt", action="store_true",
                        help="protect the secret key with a passphrase ($APPLIANCE_SIGN_PASSPHRASE, "
                        "$APPLIANCE_SIGN_PASSPHRASE_FILE, or asked on the terminal)")
    keygen.add_argument("--passphrase-file", help="encrypt with the first line of this file as the passphrase")
    keygen.add_argument("--force", action="store_true", help="overwrite existing key files")
    keygen.set_defaults(func=_keygen)

    image = verbs.add_parser("image", help="write the appliance as an OCI image archive (offline, deterministic)",
                             description="Write an OCI image archive (skopeo copy oci-archive:IMAGE.tar "
                             "docker://REGISTRY/appliance:TAG pushes it): a base layer, the installed appliance "
                             "environment as its own layer, the SBOM, entrypoint `appliance`, labels with the "
                             "version and the bundle's sha256. The same inputs give the same digest "
                             "(printed after the path).")
    image.add_argument("--env", required=True, metavar="PREFIX", help="the installed appliance (installer/install.sh "
                       "--prefix), placed at the same path in the image")
    image.add_argument("--base-oci", metavar="ARCHIVE", help="base: the site's own image as an OCI archive")
    image.add_argument("--base-root", metavar="DIR", help="base: a root directory")
    image.add_argument("--base-debs", metavar="DIR", help="base: Debian .debs (e.g. bookworm's python3.11 and what "
                       "it depends on), extracted with dpkg -x")
    image.add_argument("--bundle", metavar="TAR", help="the bundle the environment came from (its sha256 is a label)")
    image.add_argument("--sbom", metavar="FILE", help="the CycloneDX SBOM to carry at /usr/share/appliance/")
    image.add_argument("--out", required=True, type=output_file, help="the image archive to write")
    image.set_defaults(func=_image)
