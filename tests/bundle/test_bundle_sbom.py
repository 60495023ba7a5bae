"""The bundle's CycloneDX SBOMs (cyclonedx-python-lib) and `appliance bundle audit`, offline, from the bundle alone."""

import json
import subprocess
import sys
import tarfile

import pytest

import bundle_kit
from conftest import offline_cmd

ADVISORY = {  # one advisory for six 1.17.0, in the shape of PyPI's JSON API `vulnerabilities` field
    "id": "PYSEC-2099-1", "aliases": ["CVE-2099-0001", "GHSA-xxxx-yyyy-zzzz"], "summary": "six.moves imports anything",
    "details": "A long text.", "fixed_in": ["1.18.0"], "link": "https://osv.dev/vulnerability/PYSEC-2099-1",
    "source": "osv", "withdrawn": None}
WITHDRAWN = {**ADVISORY, "id": "PYSEC-2099-2", "aliases": [], "withdrawn": "2099-01-02T00:00:00Z"}


def vulnerability_data(root, wheels):
    """PyPI-style JSON (<root>/pypi/<name>/<version>/json) for every wheel but uv's (the source has no data)."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    for wheel in wheels:
        name, version, _, _ = parse_wheel_filename(wheel.name)
        name = canonicalize_name(name)
        if name == "uv":
            continue
        page = root / "pypi" / name / str(version) / "json"
        page.parent.mkdir(parents=True, exist_ok=True)
        vulns = [ADVISORY, WITHDRAWN] if name == "six" else []
        page.write_text(json.dumps({"info": {"name": name, "version": str(version)}, "urls": [],
                                    "vulnerabilities": vulns}))
    return root


def sboms(tar_path):
    with tarfile.open(tar_path) as tar:
        top = tar.getmembers()[0].name.split("/")[0]
        manifest = json.load(tar.extractfile(f"{top}/bundle.json"))
        return {python: tar.extractfile(f"{top}/{v['sbom']}").read().decode()
                for python, v in manifest["profiles"]["test"]["by_python"].items()}


def audit(tar_path, offline=True):
    """`appliance bundle audit` with no network and with cyclonedx and packaging made unimportable."""
    code = ("import sys; sys.modules['cyclonedx'] = sys.modules['packaging'] = sys.modules['packageurl'] = None; "
            "from appliance.cli import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "bundle", "audit", str(tar_path)]
    return subprocess.run(offline_cmd(cmd) if offline else cmd, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def audited(tmp_path_factory):
    """A test-profile bundle built from an HTML-only index, with vulnerability data served on loopback."""
    base = tmp_path_factory.mktemp("sbom")
    wheels = bundle_kit.cached_wheels(tmp_path_factory)
    index = bundle_kit.simple_index(base / "index", wheels)
    vulnerability_data(base / "vulns", wheels)
    with bundle_kit.Served(index) as served, bundle_kit.Served(base / "vulns") as vulns:
        proc = bundle_kit.build(base / "out", "--profile", "test", "--vulnerability-data", f"{vulns.url}/pypi",
                                cache=base / "cache", env=bundle_kit.pip_env(f"{served.url}/simple"))
        assert proc.returncode == 0, proc.stderr
        return {"tar": base / "out" / "appliance-bundle-0.1.0.tar", "vulns": vulns.url, "stderr": proc.stderr}


def test_sbom_passes_cyclonedx_strict_validation_with_spdx_licenses_and_a_dependency_graph(audited):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    for python, text in sboms(audited["tar"]).items():
        assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None, python
        sbom = json.loads(text)
        components = {c["name"]: c for c in sbom["components"]}
        assert set(components) == {"appliance", "attrs", "packaging", "python-dateutil", "six", "tomli-w", "tzdata",
                                   "uv"}
        # SPDX ids and expressions where the metadata gives them (License-Expression or License).
        assert components["six"]["licenses"] == [{"license": {"id": "MIT"}}]
        assert components["attrs"]["licenses"] == [{"license": {"id": "MIT"}}]
        assert components["packaging"]["licenses"] == [{"expression": "Apache-2.0 OR BSD-2-Clause"}]
        assert components["appliance"]["licenses"] == [{"license": {"id": "Apache-2.0"}}]
        assert all(c["hashes"][0]["alg"] == "SHA-256" and len(c["hashes"][0]["content"]) == 64
                   for c in components.values())
        # The graph: python-dateutil needs tzdata; the bundle needs what nothing else pulls in.
        deps = {d["ref"]: set(d.get("dependsOn", [])) for d in sbom["dependencies"]}
        ref = {n: c["bom-ref"] for n, c in components.items()}
        assert deps[ref["python-dateutil"]] == {ref["tzdata"]}
        root = sbom["metadata"]["component"]["bom-ref"]
        assert deps[root] == {ref[n] for n in components if n != "tzdata"}
        props = {p["name"]: p["value"] for p in sbom["metadata"]["properties"]}
        assert props["appliance:python"] == python and "appliance:cuda_major" not in props  # no "None" strings
        assert props["appliance:vulnerability_data"] == "offered"
        assert props["appliance:vulnerability_data_source"] == f"{audited['vulns']}/pypi"
        assert props["appliance:vulnerability_data_missing"] == "uv==0.13.9"
        # The withdrawn advisory is not carried; the live one affects six's component.
        (vuln,) = sbom["vulnerabilities"]
        assert vuln["id"] == "PYSEC-2099-1" and vuln["affects"][0]["ref"] == ref["six"]
        assert [r["id"] for r in vuln["references"]] == ["CVE-2099-0001", "GHSA-xxxx-yyyy-zzzz"]


def test_audit_prints_the_recorded_vulnerabilities_offline_from_the_bundle_alone(audited):
    proc = audit(audited["tar"])
    assert proc.returncode == 1, proc.stderr  # vulnerabilities listed: exit 1, as pip-audit
    lines = proc.stdout.splitlines()
    taken = json.loads(sboms(audited["tar"])["3.11"])["metadata"]["properties"]
    taken = next(p["value"] for p in taken if p["name"] == "appliance:vulnerability_data_taken")
    for python in ("3.11", "3.12"):
        assert (f"  profile test, CPython {python}: 8 packages, 1 known vulnerabilities "
                f"(data from {audited['vulns']}/pypi, taken {taken})") in lines
    assert lines.count("    six==1.17.0: PYSEC-2099-1 (CVE-2099-0001, GHSA-xxxx-yyyy-zzzz): six.moves imports "
                       "anything; fixed in 1.18.0") == 2
    assert lines.count("    no data for: uv==0.13.9") == 2


def test_an_index_without_vulnerability_data_is_said_so_in_the_sbom_and_by_audit(tmp_path, tmp_path_factory):
    from cyclonedx.schema import SchemaVersion
    from cyclonedx.validation.json import JsonStrictValidator

    index = bundle_kit.simple_index(tmp_path / "index", bundle_kit.cached_wheels(tmp_path_factory))
    with bundle_kit.Served(index) as served:  # HTML only: nothing answers beside it at /pypi
        proc = bundle_kit.build(tmp_path / "out", "--profile", "test", cache=tmp_path / "cache",
                                env=bundle_kit.pip_env(f"{served.url}/simple"))
    assert proc.returncode == 0, proc.stderr
    tar = tmp_path / "out" / "appliance-bundle-0.1.0.tar"
    for text in sboms(tar).values():
        assert JsonStrictValidator(SchemaVersion.V1_6).validate_str(text) is None
        props = {p["name"]: p["value"] for p in json.loads(text)["metadata"]["properties"]}
        assert props["appliance:vulnerability_data"] == f"none offered by {served.url}/pypi (HTTP 404)"
    proc = audit(tar)
    assert proc.returncode == 0, proc.stderr
    assert f"NO vulnerability data: none offered by {served.url}/pypi (HTTP 404)" in proc.stdout


def test_audit_refuses_an_sbom_that_does_not_match_the_bundles_sums(audited, tmp_path):
    tar = bundle_kit.rewrite_tar(audited["tar"], tmp_path / "b.tar", change=lambda name, data: (
        data.replace(b"PYSEC-2099-1", b"PYSEC-2099-0") if name.endswith("py3.12/sbom.cdx.json") else data))
    proc = audit(tar)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"appliance bundle audit: error: {tar}: profiles/test/py3.12/sbom.cdx.json does not match SHA256SUMS "
        "(the bundle was altered)"]


def test_a_source_with_only_project_pages_gives_data_for_latest_releases_only(tmp_path):
    from appliance.bundle import vulnerabilities

    for name, latest in (("six", "1.17.0"), ("attrs", "99.0")):
        page = tmp_path / "pypi" / name / "json"
        page.parent.mkdir(parents=True)
        page.write_text(json.dumps({"info": {"name": name, "version": latest}, "vulnerabilities": [ADVISORY]}))
    with bundle_kit.Served(tmp_path) as served:
        data = vulnerabilities.fetch(f"{served.url}/pypi", [("six", "1.17.0"), ("attrs", "26.1.0")])
    assert data.offered and [a.id for a in data.advisories[("six", "1.17.0")]] == ["PYSEC-2099-1"]
    assert data.no_data == {("attrs", "26.1.0"): "HTTP 404 for the release; the project page describes 99.0"}
