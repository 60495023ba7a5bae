"""`appliance bundle build`: the one file that crosses the air gap.

Layout of appliance-bundle-<version>.tar (one top directory of the same name):
  bundle.json                      what is inside: profiles, platforms, glibc floor, Pythons, CUDA
  SHA256SUMS                       sha256 of every other file (`sha256sum -c` reads it)
  wheelhouse/*.whl                 every locked wheel of every profile, once, plus this project's
  profiles/<P>/py<X.Y>/requirements.lock   the lock for CPython X.Y plus the project's wheel and its hash
  profiles/<P>/py<X.Y>/sbom.cdx.json       CycloneDX SBOM of those wheels
  installer/                       install.sh and its standard-library helpers
  weights/<file>, weights/index.json   with --weights: torchvision's published weight files (weights.py)
  tuning/<name>/                   with --tuning-db: MetaSchedule tuning databases (appliance.assets.tuning_db)
  edge-runner/run, runner.json     with a profile carrying the aarch64 TVM wheels: the edge package's
                                   bin/run, built here once (appliance.assets.edge_runner), so a site skips zig
Beside the tar: <tar>.minisig when signed (stock `minisign -V` verifies it), manifest.json.
"""

from __future__ import annotations

import datetime as _dt
import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import tomllib
from pathlib import Path

from appliance import __version__

from appliance.assets import edge_runner
from appliance.bundle import tuning, vulnerabilities, weights as pretrained
from appliance.bundle.profiles import Profile, load_profiles
from appliance.bundle.sbom import build_sbom
from appliance.bundle.wheelhouse import Target, Wheel, configured_index, fetch
from appliance.core import minisign
from appliance.core.errors import ApplianceError, ConfigError, EnvironmentProblem
from appliance.core.manifest import atomic_write_text, sha256_file, write_manifest

MADE_BY = f"appliance bundle build {__version__}"
INSTALLER_FILES = ("installer/install.sh", "installer/install_bundle.py", "installer/verify_bundle.py",
                   "appliance/core/minisign.py")
_SOURCE_FILES = ("pyproject.toml", "README.md", "setup.py", "setup.cfg", "MANIFEST.in")
_SOURCE_DIRS = ("appliance", "data_tools")


class BundleError(ApplianceError):
    """The bundle cannot be built as asked (a wheel is missing or does not match its lock)."""


def default_source() -> Path:
    """The source checkout this `appliance` runs from (it holds manifests/ and installer/)."""
    return Path(__file__).resolve().parents[2]


def project_version(source: Path) -> str:
    try:
        return tomllib.loads((source / "pyproject.toml").read_text())["project"]["version"]
    except (FileNotFoundError, KeyError):
        raise ConfigError(f"{source / 'pyproject.toml'}: no [project] version "
                          "(bundle build runs from a source checkout; pass --source)") from None


def build_project_wheel(source: Path, work: Path) -> Path:
    """This project's wheel, built offline from a copy of the source (the checkout stays clean)."""
    copy = work / "project-source"
    copy.mkdir()
    for name in _SOURCE_FILES:
        if (source / name).exists():
            shutil.copy2(source / name, copy / name)
    for name in _SOURCE_DIRS:
        if (source / name).is_dir():
            shutil.copytree(source / name, copy / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = work / "project-wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--no-index", "--disable-pip-version-check", "-w", str(out), str(copy)],
                          capture_output=True, text=True)
    wheels = list(out.glob("*.whl")) if out.exists() else []
    if proc.returncode != 0 or len(wheels) != 1:
        last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel written"]
        raise EnvironmentProblem(f"{source / 'pyproject.toml'}: building the project's wheel failed: {last[0]}")
    return wheels[0]


def _tar_add(tar: tarfile.TarFile, arcname: str, path: Path | None = None, data: bytes | None = None,
             mode: int = 0o644, mtime: int = 0) -> None:
    info = tarfile.TarInfo(arcname)
    info.size = path.stat().st_size if path is not None else len(data)
    info.mode, info.mtime = mode, mtime
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if path is not None:
        with open(path, "rb") as f:
            tar.addfile(info, f)
    else:
        tar.addfile(info, io.BytesIO(data))


def carried_runner(chosen: list[Profile], planned: dict, work: Path, source: Path) -> dict | None:
    """work/edge-runner/ built from the first aarch64 profile whose wheels hold the TVM runtime and the
    source checkout's runner.cc, for the package's default glibc floor; its bundle.json entry, or None
    when no profile carries those wheels."""
    for profile in chosen:
        wheels = [w.path for (name, _), ws in planned.items() if name == profile.name for w in ws]
        if profile.arch != "aarch64" or not all(any(w.name.startswith(prefix) for w in wheels)
                                                for prefix in edge_runner.RUNTIME_LIBS):
            continue
        started = time.monotonic()
        record = edge_runner.build_carried(wheels, work / edge_runner.CARRIED, work / "edge-runner-build",
                                           source=source / edge_runner.RUNNER_SOURCE.relative_to(default_source()))
        seconds = time.monotonic() - started
        print(f"bundle: {edge_runner.CARRIED}/run: the edge runner for glibc {record['glibc_floor']} (zig "
              f"{record['zig']}, key {record['key'][:12]}...) built from profile {profile.name}'s wheels in "
              f"{seconds:.0f} s", file=sys.stderr, flush=True)
        return {"path": edge_runner.CARRIED, "profile": profile.name, "key": record["key"],
                "glibc_floor": record["glibc_floor"], "zig": record["zig"], "sha256": record["sha256"],
                "build_s": round(seconds, 1)}
    return None


def build_bundle(profile_names: list[str], out_dir: Path, source: Path, sign_key: Path | None,
                 cache: Path, vulnerability_source: str | None = None, weight_names: list[str] = (),
                 weights_mirror: str | None = None, tuning_dbs=()) -> Path:
    """vulnerability_source: base of the PyPI-style JSON API (default: the one beside the index);
    weight_names: torchvision models whose published weights the bundle carries (weights.py);
    tuning_dbs: directories made by `appliance compile --tune`, carried as tuning/<name>/."""
    started = time.monotonic()
    manifests = source / "manifests"
    chosen = _chosen_profiles(manifests, profile_names)
    version = project_version(source)
    if sign_key is not None:
        minisign.read_secret_key(str(sign_key))  # a bad key fails now, not after the downloads
    index = configured_index()
    weight_names = list(dict.fromkeys(weight_names))
    published = pretrained.resolve_all(weight_names)  # a bad name fails before any download
    targets = [Target(profile, python) for profile in chosen for python in profile.pythons]
    tuning_entries, tuning_files = tuning.collect(tuning_dbs)  # a bad database fails before the downloads

    # 1. Every locked file of every (profile, Python), fetched and hash-checked before anything is written.
    planned = _fetch_locked(targets, cache, out_dir)
    files = {w.filename: (w.path, w.sha256) for ws in planned.values() for w in ws}
    fetched = [pretrained.fetch(p, cache / "weights", weights_mirror) for p in published]
    weights_index = {f.published.name: f.index_entry() for f in fetched}
    vulns = _vulnerability_data(vulnerability_source or vulnerabilities.default_source(index), planned)

    out_dir.mkdir(parents=True, exist_ok=True)
    top = f"appliance-bundle-{version}"
    tar_path = out_dir / f"{top}.tar"
    with tempfile.TemporaryDirectory(prefix=".bundle-build-", dir=out_dir) as tmp:
        work = Path(tmp)
        # 2. This project's own wheel, hashed into each profile's lock.
        project = None
        if any(p.project for p in chosen):
            wheel = build_project_wheel(source, work)
            project = {"file": f"wheelhouse/{wheel.name}", "name": "appliance", "version": version,
                       "sha256": sha256_file(wheel), "bytes": wheel.stat().st_size}
            files[wheel.name] = (wheel, project["sha256"])

        # 2b. The edge runner, from the carried aarch64 TVM wheels: built here once, not in every site's first package.
        runner = carried_runner(chosen, planned, work, source)
        runner_files = {f"{edge_runner.CARRIED}/{n}": work / edge_runner.CARRIED / n
                        for n in ("run", edge_runner.RUNNER_JSON)} if runner else {}

        # 3. Generated files: per (profile, Python) lock and SBOM, bundle.json, SHA256SUMS.
        generated: dict[str, bytes] = {}
        bundle_profiles = {profile.name: _profile_entry(profile, planned, project, version, files, vulns,
                                                        weights_index, runner, generated) for profile in chosen}
        manifest = _bundle_json(chosen, version, weight_names, bundle_profiles, weights_index, tuning_entries, runner)
        generated["bundle.json"] = (json.dumps(manifest, indent=2) + "\n").encode()
        weight_files = {f"weights/{f.published.file}": (f.path, f.sha256) for f in fetched}
        if fetched:
            generated["weights/index.json"] = (json.dumps(weights_index, indent=2) + "\n").encode()
        installer = {f"installer/{Path(f).name}": source / f for f in INSTALLER_FILES}
        for path in installer.values():
            if not path.exists():
                raise ConfigError(f"{path}: missing from the source checkout (the bundle carries it)")

        sums = _sums(generated, files, installer, weight_files, tuning_entries, runner_files)
        generated["SHA256SUMS"] = "".join(f"{sums[n]}  {n}\n" for n in sorted(sums)).encode()

        # 4. The tar, written beside its final name and renamed only when complete.
        mtime = int(time.time())
        partial = work / f"{top}.tar"
        members = [(generated, None), (installer, "installer"),
                   ({f"wheelhouse/{n}": p for n, (p, _) in files.items()}, None),
                   ({n: p for n, (p, _) in weight_files.items()}, None), (tuning_files, None), (runner_files, "runner")]
        _write_tar(partial, top, members, mtime)
        signature = _sign_and_place(partial, tar_path, sign_key, mtime, top, chosen)

    write_manifest(out_dir, "bundle", inputs=[manifests / "profiles.toml"] + [t.lock_file for t in targets]
                   + sorted(tuning_files.values()),
                   params=_manifest_params(chosen, sign_key, weights_index, tuning_entries, index, vulns),
                   outputs=[tar_path] + ([signature] if sign_key is not None else []))
    size = tar_path.stat().st_size
    print(f"bundle: wrote {tar_path} ({size / 1e6:.1f} MB, {len(sums) + 1} files"
          f"{', signed' if sign_key is not None else ', UNSIGNED'}) in {time.monotonic() - started:.0f} s",
          file=sys.stderr)
    return tar_path


def _chosen_profiles(manifests: Path, profile_names: list[str]) -> list[Profile]:
    """The named profiles of manifests/profiles.toml, each once, in the order given; ConfigError for an unknown one."""
    profiles = load_profiles(manifests)
    unknown = [p for p in profile_names if p not in profiles]
    if unknown:
        raise ConfigError(f"{manifests / 'profiles.toml'}: no profile {unknown[0]!r} "
                          f"(profiles: {', '.join(sorted(profiles))})")
    return [profiles[p] for p in dict.fromkeys(profile_names)]


def _fetch_locked(targets: list, cache: Path, out_dir: Path) -> dict[tuple[str, str], list[Wheel]]:
    """Every locked wheel of every target, fetched and hash-checked; BundleError listing every problem."""
    problems: list[str] = []
    planned = {}
    pins = {t.key: t.pins() for t in targets}  # every lock read (and its header checked) before any download
    for target in targets:
        planned[target.key] = fetch(target, pins[target.key], cache, problems)
    if problems:
        for line in sorted(problems):
            print(f"bundle: {line}", file=sys.stderr)
        names = sorted({m.group(1) for m in (re.search(r": (\S+?)==", line) for line in problems) if m})
        raise BundleError(f"{len(problems)} locked wheel(s) missing or mismatched ({', '.join(names)}; listed above); "
                          f"nothing was written to {out_dir}")
    return planned


def _vulnerability_data(source: str, planned: dict):
    """The advisories for every pinned version, and one line saying what the source offered."""
    vulns = vulnerabilities.fetch(source, [(w.name, w.version) for ws in planned.values() for w in ws])
    if vulns.offered:
        said = (f"{sum(len(a) for a in vulns.advisories.values())} known advisories for the "
                f"{len(vulns.advisories)} pinned versions it knows")
        if vulns.no_data:
            said += f"; nothing on {', '.join(f'{n}=={v}' for n, v in sorted(vulns.no_data))}"
    else:
        said = f"none offered ({'; '.join(sorted(set(vulns.no_data.values())))}); the SBOM says so"
    print(f"bundle: vulnerability data from {vulns.source} taken {vulns.taken}: {said}", file=sys.stderr, flush=True)
    return vulns


def _profile_entry(profile: Profile, planned: dict, project: dict | None, version: str, files: dict, vulns,
                   weights_index: dict, runner: dict | None, generated: dict[str, bytes]) -> dict:
    """bundle.json's entry of one profile; its per-Python lock and SBOM go into generated."""
    facts = {"platform": profile.platform, "glibc_floor": profile.glibc_floor,
             "pythons": list(profile.pythons), "cuda_major": profile.cuda_major}
    by_python = {}
    for python in profile.pythons:
        target = Target(profile, python)
        wheels = [{"file": f"wheelhouse/{w.filename}", "name": w.name, "version": w.version,
                   "sha256": w.sha256, "bytes": w.path.stat().st_size} for w in planned[target.key]]
        lock_text = target.lock_file.read_text()
        if profile.project:
            wheels.append(project)
            lock_text += (f"# Added by {MADE_BY}: this project's own wheel.\n"
                          f"appliance=={version} \\\n    --hash=sha256:{project['sha256']}\n")
        where = f"profiles/{profile.name}/py{python}"
        generated[f"{where}/requirements.lock"] = lock_text.encode()
        sbom = build_sbom(profile.name, python, profile.arch, version, MADE_BY, wheels,
                          {n: p for n, (p, _) in files.items()},
                          {"platform": profile.platform, "python": python, "glibc_floor": profile.glibc_floor,
                           "cuda_major": profile.cuda_major}, vulns, weights_index, runner)
        generated[f"{where}/sbom.cdx.json"] = sbom.encode()
        by_python[python] = {"python": python, "lock": f"{where}/requirements.lock",
                             "sbom": f"{where}/sbom.cdx.json", "wheels": wheels,
                             "bytes": sum(w["bytes"] for w in wheels)}
    # Every file of every Python, once: the installer carries a profile it does not install whole.
    union = list({w["file"]: w for v in by_python.values() for w in v["wheels"]}.values())
    return {"description": profile.description, **facts, "install": profile.install,
            "self_test": profile.self_test, "by_python": by_python, "wheels": union,
            "bytes": sum(w["bytes"] for w in union)}


def _bundle_json(chosen: list[Profile], version: str, weight_names: list[str], bundle_profiles: dict,
                 weights_index: dict, tuning_entries: list, runner: dict | None) -> dict:
    """bundle.json: what the bundle holds, for the installer and `bundle audit`."""
    return {
        "format": "appliance-bundle/1",
        "made_by": f"{MADE_BY}: appliance bundle build " + " ".join(f"--profile {p.name}" for p in chosen)
        + (f" --weights {','.join(weight_names)}" if weight_names else ""),
        "version": version,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platforms": sorted({p.platform for p in chosen}),
        "glibc_floor": max((p.glibc_floor for p in chosen), key=lambda v: tuple(map(int, v.split(".")))),
        "python": sorted({v for p in chosen for v in p.pythons}, key=lambda v: tuple(map(int, v.split(".")))),
        "cuda_major": sorted({p.cuda_major for p in chosen if p.cuda_major is not None}),
        "profiles": bundle_profiles,
        "weights": weights_index,
        **({"tuning_databases": tuning_entries} if tuning_entries else {}),
        **({"edge_runner": runner} if runner else {}),
    }


def _write_tar(partial: Path, top: str, members: list[tuple[dict, str | None]], mtime: int) -> None:
    """The tar, group by group in order, each group's names sorted: (name -> bytes or path, kind), kind
    "installer" (scripts executable), "runner" (bin/run executable) or None; synced to disk."""
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for group, kind in members:
            for name in sorted(group):
                item = group[name]
                extra = {"data": item} if isinstance(item, bytes) else {"path": item}
                if kind == "installer":
                    extra["mode"] = 0o755 if name.endswith(".sh") else 0o644
                elif kind == "runner":
                    extra["mode"] = 0o755 if name.endswith("/run") else 0o644
                _tar_add(tar, f"{top}/{name}", mtime=mtime, **extra)
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())


def _sign_and_place(partial: Path, tar_path: Path, sign_key: Path | None, mtime: int, top: str,
                    chosen: list[Profile]) -> Path:
    """Sign the finished tar (when a key is given), move it to tar_path, and write or clear its .minisig."""
    signature = tar_path.parent / f"{top}.tar.minisig"
    if sign_key is not None:
        comment = f"timestamp:{mtime}\tfile:{top}.tar\tprofiles:{','.join(p.name for p in chosen)}"
        sig_text = minisign.sign_file(str(partial), str(sign_key), comment)
    os.replace(partial, tar_path)
    if sign_key is not None:
        atomic_write_text(signature, sig_text)
    else:
        signature.unlink(missing_ok=True)  # a stale signature would not match this tar
    return signature


def _sums(generated: dict[str, bytes], files: dict, installer: dict, weight_files: dict, tuning_entries: list,
          runner_files: dict) -> dict[str, str]:
    """name in the bundle -> sha256 of every file it holds (SHA256SUMS itself aside)."""
    sums = {name: hashlib.sha256(data).hexdigest() for name, data in generated.items()}
    sums.update({f"wheelhouse/{n}": digest for n, (_, digest) in files.items()})
    sums.update({name: sha256_file(p) for name, p in installer.items()})
    sums.update({name: digest for name, (_, digest) in weight_files.items()})
    sums.update({e["file"]: e["sha256"] for entry in tuning_entries for e in entry["files"]})
    sums.update({name: sha256_file(p) for name, p in runner_files.items()})
    return sums


def _manifest_params(chosen: list[Profile], sign_key: Path | None, weights_index: dict, tuning_entries: list,
                     index: str, vulns) -> dict:
    """The bundle stage manifest's parameters."""
    return {"profiles": [p.name for p in chosen], "signed": sign_key is not None,
            "weights": {n: {"url": e["url"], "sha256": e["sha256"]} for n, e in weights_index.items()},
            "tuning_databases": [e["name"] for e in tuning_entries],
            "index": index, "vulnerability_data": {"source": vulns.source, "taken": vulns.taken,
                                                   "offered": vulns.offered}}
