"""`appliance bundle audit BUNDLE`: the known vulnerabilities that travelled, from the bundle alone.

Standard library only (it runs on the air-gapped side): reads bundle.json and each (profile, Python)
SBOM out of the tar, checks each SBOM against the tar's SHA256SUMS, and prints the advisories the
build recorded, with where and when that data was taken. The signature is the installer's job
(or `minisign -V`); run that first on a bundle of unknown origin.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import DataError


@dataclass(frozen=True)
class Finding:
    profile: str
    python: str
    name: str
    version: str
    id: str
    aliases: tuple[str, ...]
    summary: str
    fixed_in: str


@dataclass
class AuditResult:
    lines: list[str]
    findings: list[Finding]
    unknown: list[str]  # (profile, Python) whose SBOM carries no vulnerability data


MAX_READ_BYTES = 64 << 20  # bundle.json, SHA256SUMS and an SBOM are kilobytes to a few MB


def _read(tar: tarfile.TarFile, bundle: Path, name: str) -> bytes:
    try:
        member = tar.extractfile(name)
    except KeyError:
        member = None
    if member is None:
        raise DataError(f"{bundle}: no {name} in the bundle (not an appliance bundle, or damaged)")
    data = member.read(MAX_READ_BYTES + 1)
    if len(data) > MAX_READ_BYTES:
        raise DataError(f"{bundle}: {name} is larger than {MAX_READ_BYTES >> 20} MiB, not what a bundle holds")
    return data


def audit(bundle: Path) -> AuditResult:
    """The report; one line for a bundle that is not one (a device or a pipe is never read: a link to
    /dev/zero or a FIFO would be read, or waited on, forever)."""
    if Path(bundle).exists() and not Path(bundle).is_file() and not Path(bundle).is_dir():
        raise DataError(f"{bundle}: not a regular file (a device or a pipe), so not a bundle tar")
    try:
        tar = tarfile.open(bundle)
    except (OSError, tarfile.TarError) as err:
        # tarfile's auto mode names every compression it tried, one per line: one reason is enough.
        reason = ("not a tar file, plain or compressed" if isinstance(err, tarfile.ReadError)
                  else err.strerror if isinstance(err, OSError) and err.strerror else " ".join(str(err).split()))
        raise DataError(f"{bundle}: cannot read the bundle tar ({reason})") from None
    with tar:
        first = tar.next()
        if first is None:
            raise DataError(f"{bundle}: empty tar")
        top = first.name.split("/")[0]
        try:
            manifest = json.loads(_read(tar, bundle, f"{top}/bundle.json"))
        except (ValueError, RecursionError) as err:
            raise DataError(f"{bundle}: {top}/bundle.json is not JSON ({str(err)[:200]})") from None
        sums = {}
        for line in _read(tar, bundle, f"{top}/SHA256SUMS").decode("utf-8", "replace").splitlines():
            digest, _, name = line.partition("  ")
            sums[name] = digest
        result = AuditResult(lines=[], findings=[], unknown=[])
        try:
            for profile, entry in sorted(manifest.get("profiles", {}).items()):
                variants = entry.get("by_python") or {entry.get("python", "?"): entry}  # older bundles: one SBOM
                for python, variant in variants.items():
                    _audit_sbom(tar, bundle, top, sums, profile, python, variant["sbom"], result)
        except (AttributeError, KeyError, TypeError) as err:  # a field of another type, or none, anywhere
            raise DataError(f"{bundle}: {top}/bundle.json or an SBOM is not as `appliance bundle build` writes it "
                            f"({type(err).__name__}: {str(err)[:120]})") from None
    return result


def _audit_sbom(tar, bundle: Path, top: str, sums: dict, profile: str, python: str, path: str,
                result: AuditResult) -> None:
    data = _read(tar, bundle, f"{top}/{path}")
    if sums.get(path) != hashlib.sha256(data).hexdigest():
        raise DataError(f"{bundle}: {path} does not match SHA256SUMS (the bundle was altered)")
    try:
        sbom = json.loads(data)
    except (ValueError, RecursionError) as err:
        raise DataError(f"{bundle}: {path} is not JSON ({str(err)[:200]})") from None
    props = {p["name"]: p["value"] for p in sbom.get("metadata", {}).get("properties", [])}
    components = {c["bom-ref"]: c for c in sbom.get("components", [])
                  if "bom-ref" in c and c.get("type") == "library"}  # packages, not weights or the edge runner
    where = f"profile {profile}, CPython {python}"
    state = props.get("appliance:vulnerability_data")
    if state is None:
        result.lines.append(f"{where}: {len(components)} packages; the SBOM carries no vulnerability data "
                            "(made before bundles recorded it)")
        result.unknown.append(where)
        return
    source = props.get("appliance:vulnerability_data_source", "?")
    taken = props.get("appliance:vulnerability_data_taken", "?")
    if state != "offered":
        result.lines.append(f"{where}: {len(components)} packages; NO vulnerability data: {state}, at {taken}")
        result.unknown.append(where)
        return
    found = []
    for v in sbom.get("vulnerabilities", []):
        aliases = tuple(r["id"] for r in v.get("references", []))
        fixed = next((p["value"] for p in v.get("properties", []) if p["name"] == "appliance:fixed_in"), "")
        for target in v.get("affects", []):
            c = components.get(target["ref"], {"name": target["ref"], "version": "?"})
            found.append(Finding(profile, python, c["name"], c["version"], v.get("id", "?"), aliases,
                                 v.get("description", ""), fixed))
    found.sort(key=lambda f: (f.name, f.id))
    result.lines.append(f"{where}: {len(components)} packages, {len(found)} known vulnerabilities "
                        f"(data from {source}, taken {taken})")
    if props.get("appliance:vulnerability_data_missing"):
        result.lines.append(f"  no data for: {props['appliance:vulnerability_data_missing']}")
    for f in found:
        also = f" ({', '.join(f.aliases)})" if f.aliases else ""
        fix = f"fixed in {f.fixed_in}" if f.fixed_in else "no fixed version known"
        result.lines.append(f"  {f.name}=={f.version}: {f.id}{also}: {f.summary or 'no summary'}; {fix}")
    result.findings.extend(found)

