"""`appliance bundle image --env PREFIX --out IMAGE.tar`: the appliance as an OCI image archive, offline.

Layers, lowest first: the base (the site's own base image as an OCI archive, a root directory, or
Debian .debs extracted with `dpkg -x` the way the edge sysroot is made), the installed appliance
environment at its own absolute path (a venv's scripts name it), and the SBOM at
/usr/share/appliance/. The entrypoint is the environment's `appliance`; labels carry the version
and, given the bundle, its sha256. Deterministic (appliance.bundle.oci): the same inputs give the
same digest, which `appliance train k8s --image REF@sha256:...` pins.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from appliance import __version__
from appliance.bundle.oci import ImageConfig, read_base, write_image
from appliance.core.errors import ConfigError, EnvironmentProblem

SBOM_PATH = "usr/share/appliance"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _debs_root(debs: Path, into: Path) -> Path:
    found = sorted(debs.glob("*.deb"))
    if not found:
        raise ConfigError(f"--base-debs {debs}: no .deb files there")
    if shutil.which("dpkg") is None:
        raise EnvironmentProblem("dpkg: not found (needed to extract --base-debs)")
    for deb in found:
        done = subprocess.run(["dpkg", "-x", str(deb), str(into)], capture_output=True, text=True)
        if done.returncode != 0:
            raise ConfigError(f"{deb}: dpkg -x failed: {(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return into


def build_image(out: Path, env: Path, *, base_oci: Path | None = None, base_root: Path | None = None,
                base_debs: Path | None = None, bundle: Path | None = None, sbom: Path | None = None,
                ref: str = __version__) -> str:
    """Write the image archive to out; returns its manifest digest."""
    env = Path(env).resolve()
    if not (env / "bin" / "appliance").is_file():
        raise ConfigError(f"--env {env}: no bin/appliance there (give the prefix installer/install.sh made)")
    bases = [b for b in (base_oci, base_root, base_debs) if b]
    if len(bases) != 1:
        raise ConfigError("give one base: --base-oci ARCHIVE (the site's image), --base-root DIR or --base-debs DIR")
    for flag, path in (("--bundle", bundle), ("--sbom", sbom)):
        if path and not Path(path).is_file():
            raise ConfigError(f"{flag} {path}: no such file")
    labels = {"org.opencontainers.image.title": "appliance", "org.opencontainers.image.version": __version__}
    runtime_env = (f"PATH={env}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
    with tempfile.TemporaryDirectory(prefix="appliance-image-") as tmp:
        layers: list = []
        if base_oci:
            base_layers, base_config = read_base(Path(base_oci))
            layers += base_layers
            labels = {**(base_config.get("config", {}).get("Labels") or {}), **labels}
        elif base_root:
            layers.append(Path(base_root))
        else:
            layers.append(_debs_root(Path(base_debs), Path(tmp) / "debs-root"))
        layers.append((env, str(env)))
        if bundle:
            labels["appliance.bundle.sha256"] = _sha256(Path(bundle))
        if sbom:
            sbom_dir = Path(tmp) / "sbom"
            sbom_dir.mkdir()
            shutil.copyfile(sbom, sbom_dir / "sbom.cdx.json")
            layers.append((sbom_dir, SBOM_PATH))
            labels["appliance.sbom"] = f"/{SBOM_PATH}/sbom.cdx.json"
            labels["appliance.sbom.sha256"] = _sha256(Path(sbom))
        config = ImageConfig(entrypoint=(f"{env}/bin/appliance",), cmd=("doctor",), env=runtime_env, labels=labels)
        return write_image(Path(out), layers, config, ref=ref)
