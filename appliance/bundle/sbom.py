"""CycloneDX 1.6 SBOM (JSON) of one (profile, Python), made with cyclonedx-python-lib on the connected host.

Per wheel: name, version, purl, sha256, SPDX license id or expression where the wheel's METADATA gives
one (License-Expression, an SPDX id in License, or an unambiguous classifier; else the license's name),
and its dependencies from Requires-Dist, evaluated for the target Python and platform. Known
vulnerabilities of the pinned versions come from the index's data (vulnerabilities.py), with the source
and the time they were taken in the metadata properties; `appliance bundle audit` prints them offline.
Pretrained weight files the bundle carries (--weights) are `machine-learning-model` components with
their sha256 and the published URL as a distribution reference; the prebuilt edge runner
(edge-runner/run) is an `application` component with its sha256, key, glibc floor and zig version.
"""

from __future__ import annotations

import email.message
import email.parser
import zipfile
from pathlib import Path

from cyclonedx.model import (ExternalReference, ExternalReferenceType, HashAlgorithm, HashType, Property,
                             XsUri)
from cyclonedx.model.bom import Bom
from cyclonedx.model.component import Component, ComponentType
from cyclonedx.model.impact_analysis import ImpactAnalysisAffectedStatus
from cyclonedx.model.tool import ToolRepository
from cyclonedx.model.vulnerability import (BomTarget, BomTargetVersionRange, Vulnerability,
                                           VulnerabilityReference, VulnerabilitySource)
from cyclonedx.output.json import JsonV1Dot6
from packageurl import PackageURL
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from appliance.bundle.vulnerabilities import VulnerabilityData

# Trove classifiers that name exactly one SPDX license (others, e.g. "BSD License", stay names).
_CLASSIFIER_SPDX = {
    "MIT License": "MIT", "ISC License (ISCL)": "ISC", "Mozilla Public License 2.0 (MPL 2.0)": "MPL-2.0",
    "Python Software Foundation License": "PSF-2.0", "The Unlicense (Unlicense)": "Unlicense",
    "Boost Software License 1.0 (BSL-1.0)": "BSL-1.0", "zlib/libpng License": "Zlib",
    "Apache Software License 2.0 (Apache-2.0)": "Apache-2.0", "MIT No Attribution License (MIT-0)": "MIT-0",
}


def wheel_metadata(path: Path) -> email.message.Message | None:
    """The wheel's METADATA headers (reads only that member)."""
    try:
        with zipfile.ZipFile(path) as zf:
            name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
            return email.parser.BytesHeaderParser().parsebytes(zf.read(name))
    except (zipfile.BadZipFile, StopIteration, OSError):
        return None


def licenses(meta: email.message.Message | None) -> list:
    """SPDX expression or ids where the metadata gives them, else the license's name."""
    from cyclonedx.contrib.license.factories import LicenseFactory
    from cyclonedx.model.license import DisjunctiveLicense
    from cyclonedx.spdx import fixup_id, is_expression

    if meta is None:
        return []
    factory = LicenseFactory()
    expression = (meta.get("License-Expression") or "").strip()
    if expression:
        return [factory.make_from_string(expression)]
    text = (meta.get("License") or "").strip()
    if text and "\n" not in text and len(text) <= 80 and (fixup_id(text) or is_expression(text)):
        return [factory.make_from_string(text)]
    classifiers = [c.split(" :: ")[-1] for c in meta.get_all("Classifier") or [] if c.startswith("License ::")]
    if classifiers:
        return [DisjunctiveLicense(id=_CLASSIFIER_SPDX[c]) if c in _CLASSIFIER_SPDX else DisjunctiveLicense(name=c)
                for c in dict.fromkeys(classifiers)]
    if text and "\n" not in text and len(text) <= 80:
        return [DisjunctiveLicense(name=text)]
    return []


def _marker_env(python: str, arch: str) -> dict:
    return {"python_version": python, "python_full_version": f"{python}.0", "implementation_name": "cpython",
            "platform_python_implementation": "CPython", "implementation_version": f"{python}.0",
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": arch,
            "platform_release": "", "platform_version": "", "extra": ""}


def requires(meta: email.message.Message | None, python: str, arch: str) -> list[str]:
    """Canonical names of the distributions this wheel needs on the target (no extras)."""

    out = []
    for line in (meta.get_all("Requires-Dist") or []) if meta is not None else []:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is None or req.marker.evaluate(_marker_env(python, arch)):
            out.append(canonicalize_name(req.name))
    return out


def build_sbom(profile_name: str, python: str, arch: str, bundle_version: str, made_by: str, wheels: list[dict],
               paths: dict[str, Path], properties: dict, vulns: VulnerabilityData,
               weights: dict[str, dict] | None = None, runner: dict | None = None) -> str:
    """wheels: [{"file", "name", "version", "sha256"}]; paths: filename -> local file; weights: the bundle's
    weights/index.json; runner: bundle.json's edge_runner entry. Returns the JSON text."""
    root = Component(type=ComponentType.APPLICATION, name=f"appliance-bundle-{profile_name}", version=bundle_version,
                     bom_ref=f"appliance-bundle-{profile_name}-py{python}")
    bom = Bom()
    bom.metadata.component = root
    tools = ToolRepository()
    tools.components.add(Component(type=ComponentType.APPLICATION, name="appliance", version=bundle_version,
                                   description=made_by))
    bom.metadata.tools = tools
    for key, value in _properties(properties, vulns, wheels).items():
        bom.metadata.properties.add(Property(name=f"appliance:{key}", value=str(value)))
    components, needed = _wheel_components(bom, wheels, paths, python, arch)
    models = _site_components(weights, runner)
    for model in models:
        bom.components.add(model)
        bom.register_dependency(model, [])
    # The bundle depends on what nothing else in it pulls in: the lock's top-level requirements.
    bom.register_dependency(root, [c for c in components.values() if c.name not in needed] + models)
    _add_vulnerabilities(bom, components, vulns)
    return JsonV1Dot6(bom).output_as_string(indent=2) + "\n"


def _properties(properties: dict, vulns: VulnerabilityData, wheels: list[dict]) -> dict:
    """The bundle's properties and what the vulnerability data covered."""
    props = {**{k: v for k, v in properties.items() if v is not None}, "vulnerability_data_source": vulns.source,
             "vulnerability_data_taken": vulns.taken}
    if not vulns.offered:
        reasons = sorted(set(vulns.no_data.values()))
        props["vulnerability_data"] = f"none offered by {vulns.source} ({'; '.join(reasons) or 'nothing asked'})"
    else:
        props["vulnerability_data"] = "offered"
        missing = sorted(f"{n}=={v}" for (n, v) in vulns.no_data if any(
            canonicalize_name(w["name"]) == n and w["version"] == v for w in wheels))
        if missing:
            props["vulnerability_data_missing"] = ", ".join(missing)
    return props


def _wheel_components(bom, wheels: list[dict], paths: dict[str, Path], python: str, arch: str) -> tuple[dict, set]:
    """A component per wheel with its dependencies registered: ({canonical name: component}, the names some
    other wheel requires)."""
    components, metas = {}, {}
    for w in sorted(wheels, key=lambda w: w["name"]):
        filename = Path(w["file"]).name
        meta = metas[canonicalize_name(w["name"])] = wheel_metadata(paths[filename])
        purl = PackageURL(type="pypi", name=w["name"], version=w["version"], qualifiers={"file_name": filename})
        components[canonicalize_name(w["name"])] = component = Component(
            type=ComponentType.LIBRARY, name=w["name"], version=w["version"], purl=purl, bom_ref=purl.to_string(),
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=w["sha256"])], licenses=licenses(meta),
            description=(meta.get("Summary") or None) if meta is not None else None)
        bom.components.add(component)

    needed = set()
    for name, component in components.items():
        deps = [components[d] for d in dict.fromkeys(requires(metas[name], python, arch)) if d in components]
        needed.update(d.name for d in deps)
        bom.register_dependency(component, deps)
    return components, needed


def _site_components(weights: dict[str, dict] | None, runner: dict | None) -> list:
    """What a site carries besides wheels: the pretrained weights and the prebuilt edge runner."""
    models = []
    for name, entry in sorted((weights or {}).items()):
        models.append(Component(
            type=ComponentType.MACHINE_LEARNING_MODEL, name=name, version=entry["weights"].rsplit(".", 1)[-1],
            bom_ref=f"weights/{entry['file']}", description=f"torchvision {entry['weights']} ({entry['file']})",
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=entry["sha256"])],
            external_references=[ExternalReference(type=ExternalReferenceType.DISTRIBUTION, url=XsUri(entry["url"]),
                                                   hashes=[HashType(alg=HashAlgorithm.SHA_256,
                                                                    content=entry["sha256"])])],
            properties=[Property(name="appliance:file", value=f"weights/{entry['file']}")]))
    if runner:
        models.append(Component(
            type=ComponentType.APPLICATION, name="appliance-edge-runner", version=runner["key"][:12],
            bom_ref=f"{runner['path']}/run", description=f"bin/run of edge packages, aarch64, glibc >= "
            f"{runner['glibc_floor']}, built with zig {runner['zig']}",
            hashes=[HashType(alg=HashAlgorithm.SHA_256, content=runner["sha256"])],
            properties=[Property(name=f"appliance:{k}", value=str(v)) for k, v in
                        (("file", f"{runner['path']}/run"), ("key", runner["key"]),
                         ("glibc_floor", runner["glibc_floor"]), ("zig", runner["zig"]))]))
    return models


def _add_vulnerabilities(bom, components: dict, vulns: VulnerabilityData) -> None:
    """The advisories that name a bundled wheel's exact version."""
    for (name, version), advisories in sorted(vulns.advisories.items()):
        component = components.get(name)
        if component is None or component.version != version:
            continue
        for a in advisories:
            source = VulnerabilitySource(name=a.source or "PyPI", url=XsUri(a.link) if a.link else None)
            bom.vulnerabilities.add(Vulnerability(
                bom_ref=f"{a.id}@{component.bom_ref}", id=a.id, source=source,
                references=[VulnerabilityReference(id=alias, source=VulnerabilitySource(name=a.source or "PyPI"))
                            for alias in a.aliases],
                description=a.summary or None, detail=a.details or None,
                recommendation=f"upgrade to {' or '.join(a.fixed_in)}" if a.fixed_in else "no fixed version known",
                affects=[BomTarget(ref=component.bom_ref, versions=[BomTargetVersionRange(
                    version=version, status=ImpactAnalysisAffectedStatus.AFFECTED)])],
                properties=[Property(name="appliance:fixed_in", value=", ".join(a.fixed_in))] if a.fixed_in else None))