"""CycloneDX 1.5 SBOM (JSON) for one profile: every wheel with version, purl, sha256, license."""

from __future__ import annotations

import datetime as _dt
import email.parser
import uuid
import zipfile
from pathlib import Path


def _wheel_metadata(path: Path) -> dict:
    """Summary and license from the wheel's METADATA (reads only that member)."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            meta = email.parser.BytesHeaderParser().parsebytes(zf.read(name))
    except (zipfile.BadZipFile, StopIteration, OSError):
        return {}
    out = {}
    if meta.get("Summary"):
        out["description"] = meta["Summary"]
    if meta.get("License-Expression"):
        out["licenses"] = [{"expression": meta["License-Expression"]}]
    else:
        text = (meta.get("License") or "").strip()
        if text and "\n" not in text and len(text) <= 80:
            out["licenses"] = [{"license": {"name": text}}]
        else:
            classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
            if classifiers:
                out["licenses"] = [{"license": {"name": c}} for c in classifiers]
    return out


def build_sbom(profile_name: str, bundle_version: str, made_by: str, wheels: list[dict], paths: dict[str, Path],
               properties: dict) -> dict:
    """wheels: [{"file", "name", "version", "sha256"}]; paths: filename -> local file for METADATA."""
    components = []
    for w in sorted(wheels, key=lambda w: w["name"]):
        filename = Path(w["file"]).name
        purl = f"pkg:pypi/{w['name']}@{w['version']}?file_name={filename}"
        components.append({
            "type": "library",
            "bom-ref": purl,
            "name": w["name"],
            "version": w["version"],
            "purl": purl,
            "hashes": [{"alg": "SHA-256", "content": w["sha256"]}],
            **_wheel_metadata(paths[filename]),
        })
    return {
        "bomFormat": "CycloneDX",
        "specVersion": "1.5",
        "serialNumber": f"urn:uuid:{uuid.uuid4()}",
        "version": 1,
        "metadata": {
            "timestamp": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "tools": {"components": [{"type": "application", "name": "appliance", "version": bundle_version,
                                      "description": made_by}]},
            "component": {"type": "application", "bom-ref": f"appliance-bundle-{profile_name}",
                          "name": f"appliance-bundle-{profile_name}", "version": bundle_version},
            "properties": [{"name": f"appliance:{k}", "value": str(v)} for k, v in properties.items()],
        },
        "components": components,
    }
