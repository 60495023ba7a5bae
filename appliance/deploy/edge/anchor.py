"""`appliance edge anchor`: the device's trust anchor, installed once on each device with the site's key.

A package's own install.sh is the script a person runs, so a tampered package could run its first line
before any check. The anchor removes that window for every package after it: edge-anchor.tar holds
`install-package` (this appliance's install.sh, which runs in anchor mode from the anchor's folder),
`bin/verify` (edge/anchor.cc: the minisign check of edge/signature.h, cross-compiled with zig for the
glibc floor, no other library) and `trusted.pub` (the site's public key), with SHA256SUMS signed by
the site key so that stock `minisign` checks the anchor itself before it is copied onto the device.
On the device, `ANCHOR/install-package --package DIR` verifies DIR's signature with the anchor's key
and program, its SHA256SUMS and that nothing unlisted is there, before any byte of DIR runs; only then
does the package's (now verified) bin/run --selftest run. docs/edge.md says how to install it.
"""

from __future__ import annotations

import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

from appliance.assets.edge_runner import zig_command
from appliance.core.errors import EnvironmentProblem
from appliance.core.manifest import atomic_write_text, sha256_file
from appliance.deploy.edge.glibc_floor import DEFAULT_GLIBC_FLOOR, check_floor, parse_floor
from appliance.deploy.edge.signing import sign_sums, site_key

HERE = Path(__file__).resolve().parent
ROOT_NAME = "edge-anchor"
VERIFIER_SOURCE, VERIFIER_HEADERS = HERE / "anchor.cc", ("signature.h", "hashes.h")


def build_verifier(out: Path, glibc_floor: str) -> None:
    """bin/verify: anchor.cc for aarch64 at the glibc floor (zig c++; seconds once zig's libc++ is built)."""
    cmd = [*zig_command(), "-target", f"aarch64-linux-gnu.{glibc_floor}", "-std=c++17", "-O2", "-fno-exceptions",
           "-I", str(HERE), str(VERIFIER_SOURCE), "-o", str(out), "-s"]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(f"{VERIFIER_SOURCE}: zig c++ ran past 900 s") from None
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise EnvironmentProblem(f"{VERIFIER_SOURCE}: cross compile with zig failed: {errors[0].strip()}")


def build_anchor(out: Path, *, key=None, glibc_floor: str = DEFAULT_GLIBC_FLOOR) -> dict:
    """out (a tar holding edge-anchor/): install-package, bin/verify, trusted.pub, SHA256SUMS(.minisig)."""
    out, glibc_floor = Path(out), parse_floor(glibc_floor)
    key, pub, key_id, _ = site_key(key)
    with tempfile.TemporaryDirectory(prefix="edge-anchor-") as tmp:
        root = Path(tmp) / ROOT_NAME
        (root / "bin").mkdir(parents=True)
        build_verifier(root / "bin" / "verify", glibc_floor)
        check_floor({"bin/verify": root / "bin" / "verify"}, glibc_floor)
        shutil.copyfile(HERE / "install.sh", root / "install-package")
        shutil.copyfile(pub, root / "trusted.pub")
        for name, mode in (("install-package", 0o755), ("bin/verify", 0o755), ("trusted.pub", 0o644)):
            (root / name).chmod(mode)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        atomic_write_text(root / "SHA256SUMS", "".join(f"{sha256_file(p)}  {p.relative_to(root)}\n" for p in files))
        sign_sums(root, key, f"edge-anchor\tkey:{key_id}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(root, arcname=ROOT_NAME)
        partial.replace(out)
    return {"out": str(out), "key_id": key_id, "public_key": str(pub)}
