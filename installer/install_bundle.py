"""Install an appliance bundle offline: the steps behind installer/install.sh.

Standard library only (python3 >= 3.10). Order: one read of BUNDLE into a private copy
(PREFIX/.staging-*/, mode 0700), then on that copy only: signature, SHA256SUMS, safe extraction;
versioned venv, install with --no-index --only-binary :all: --require-hashes (uv from the
bundle when it carries one, else pip), self-test, then `current` is switched atomically.

PREFIX/
  releases/<version>-<sha12>/  venv/, bundle/ (bundle.json, lock, SBOM), wheelhouse/<carried profile>/,
                               weights/ (pretrained weight files and index.json, when the bundle has them),
                               tuning/<name>/ (tuning databases the bundle carries; `appliance compile`
                               finds them next to its venv),
                               edge-runner/ (run + runner.json: the edge packages' prebuilt bin/run,
                               which `appliance package` finds next to its venv),
                               doctor.json (the `appliance doctor --json` report of the self-test),
                               install.json (written last: a release without it is incomplete)
  logs/                        full output of pip/uv and the self-test, one file per install
  current -> releases/...      what users run: PREFIX/current/venv/bin/appliance
  previous -> releases/...     what --rollback returns to
A failure at any step removes only the new release; current and previous are not touched.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_bundle import Refusal, check_signature, check_sums, extract, private_copy, read_small  # noqa: E402

SELF_TEST_TIMEOUT_S = 900


def log(message: str) -> None:
    print(f"install: {message}", file=sys.stderr, flush=True)


def clean_env(venv: Path | None = None) -> dict:
    """The environment for every child: no PYTHONPATH/pip/uv settings from the caller's shell."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "PIP_", "UV_", "VIRTUAL_ENV", "CONDA"))}
    if venv is not None:
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '/usr/bin:/bin')}"
        env["VIRTUAL_ENV"] = str(venv)
    return env


def run(cmd: list, what: str, log_file: Path, env: dict, timeout: float | None = None, cwd=None):
    """Run cmd; on failure refuse with its last line, keeping the whole output in log_file."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, env=env, timeout=timeout,
                              cwd=cwd)
    except subprocess.TimeoutExpired:
        raise Refusal(f"{what}: did not finish within {timeout} s") from None
    with open(log_file, "a") as f:
        f.write(f"$ {' '.join(map(str, cmd))}\n{proc.stdout}{proc.stderr}\n"
                f"(exit {proc.returncode}, {time.monotonic() - t0:.2f} s)\n")
    if proc.returncode != 0:
        last = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()[-1]
        raise Refusal(f"{what}: exit status {proc.returncode}: {last} (full output: {log_file})")
    return proc


def target_facts(python: str) -> dict:
    code = ("import json, platform, sys; print(json.dumps({'machine': platform.machine(), "
            "'python': '%d.%d' % sys.version_info[:2], 'libc': platform.libc_ver()}))")
    proc = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, env=clean_env())
    if proc.returncode != 0:
        raise Refusal(f"{python}: cannot run ({proc.stderr.strip()[-200:]})")
    return json.loads(proc.stdout)


def bundle_holds(manifest: dict) -> str:
    """What a bundle offers, for refusals: each profile with its platform and CPython versions."""
    parts = []
    for name, d in manifest["profiles"].items():
        pythons = d.get("pythons") or [d.get("python", "?")]
        parts.append(f"{name} ({d.get('platform', '?')}, CPython {'/'.join(pythons)}"
                     f"{'' if d.get('install') else ', carried only'})")
    return ", ".join(parts) or "no profiles"


def this_host(facts: dict, python: str) -> str:
    libc, version = facts["libc"]
    return f"{facts['machine']}, CPython {facts['python']} ({python}), {libc or 'no glibc'} {version}".rstrip()


def choose_profile(manifest: dict, wanted: str | None, facts: dict, bundle: Path, python: str) -> str:
    profiles = manifest["profiles"]
    if wanted is not None:
        if wanted not in profiles or not profiles[wanted]["install"]:
            raise Refusal(f"{bundle}: no installable profile {wanted!r}; the bundle holds {bundle_holds(manifest)}")
        return wanted
    fits = [p for p, d in profiles.items() if d["install"] and d["platform"].startswith(facts["machine"] + "-")]
    if not fits:
        raise Refusal(f"{bundle}: no installable profile for this host ({this_host(facts, python)}); "
                      f"the bundle holds {bundle_holds(manifest)}")
    if len(fits) > 1:
        raise Refusal(f"{bundle}: {len(fits)} installable profiles for {facts['machine']} "
                      f"({', '.join(fits)}): pass --profile")
    return fits[0]


def for_python(profile: dict, name: str, facts: dict, python: str, bundle: Path) -> dict:
    """The profile as this interpreter gets it: the lock, SBOM and wheels for its CPython version."""
    by_python = profile.get("by_python")
    if by_python is None:  # a bundle made before a profile could serve several Pythons
        return profile
    if facts["python"] not in by_python:
        raise Refusal(f"{python}: CPython {facts['python']} on {facts['machine']}; profile {name} of {bundle.name} "
                      f"serves CPython {', '.join(by_python)} on {profile['platform']} "
                      "(pass --python PATH to one of those)")
    return {**profile, **by_python[facts["python"]]}


def check_host(profile: dict, name: str, facts: dict, python: str) -> None:
    arch = profile["platform"].split("-", 1)[0]
    if facts["machine"] != arch:
        raise Refusal(f"{python}: profile {name} is for {arch}, this host is {facts['machine']}")
    if facts["python"] != profile["python"]:
        raise Refusal(f"{python}: profile {name} needs CPython {profile['python']}, this is {facts['python']} "
                      "(pass --python PATH)")
    libc, version = facts["libc"]
    floor = tuple(int(x) for x in profile["glibc_floor"].split("."))
    if libc != "glibc" or tuple(int(x) for x in version.split(".")[:2]) < floor:
        raise Refusal(f"{python}: profile {name} needs glibc >= {profile['glibc_floor']}, this host has "
                      f"{libc or 'no glibc'} {version}")


def version_key(text: str) -> tuple | None:
    """A sort key for PEP 440 versions of the usual shapes (1.2, 1.2.3rc1, 1.2.post1, 1.2.dev3), or None."""
    m = re.fullmatch(r"v?(\d+(?:\.\d+)*)(?:(a|b|rc)(\d+))?(?:\.post(\d+))?(?:\.dev(\d+))?(?:\+[a-z0-9.]+)?",
                     text.strip().lower())
    if m is None:
        return None
    release = tuple(int(x) for x in m[1].split("."))
    release += (0,) * (8 - len(release))  # 1.2 == 1.2.0
    pre = (("a", "b", "rc").index(m[2]), int(m[3])) if m[2] else (3, 0)  # a final release follows its rcs
    if m[5] is not None and not m[2] and m[4] is None:
        pre = (-1, 0)  # 1.0.dev1 comes before 1.0a1
    post = int(m[4]) if m[4] is not None else -1
    dev = int(m[5]) if m[5] is not None else float("inf")
    return release, pre, post, dev


def refuse_downgrade(prefix: Path, current: str | None, version: str, bundle: Path, allowed: bool) -> None:
    """A bundle older than the current install is refused unless --allow-downgrade (an old bundle
    signed with the same key stays valid forever; installing it must be a decision)."""
    if current is None or allowed:
        return
    installed = json.loads(read_small(prefix / "releases" / current / "install.json", "install record"))["version"]
    new, old = version_key(version), version_key(installed)
    if new is None or old is None:
        raise Refusal(f"{bundle}: cannot tell whether version {version} is older than the installed {installed} "
                      "(pass --allow-downgrade to install it anyway)")
    if new < old:
        raise Refusal(f"{bundle}: version {version} is older than the installed {installed} "
                      f"({prefix / 'current'} -> releases/{current}); pass --allow-downgrade to install it "
                      "anyway, or --rollback to return to the previous install")


def uv_binary(wheelhouse: Path, wheels: list[dict], work: Path) -> Path | None:
    """The uv executable out of the bundle's uv wheel (a zip: no install needed to use it)."""
    uv = [w for w in wheels if w["name"] == "uv"]
    if not uv:
        return None
    with zipfile.ZipFile(wheelhouse / Path(uv[0]["file"]).name) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".data/scripts/uv")), None)
        if member is None:
            return None
        target = work / "uv"
        target.write_bytes(zf.read(member))
    target.chmod(0o755)
    ok = subprocess.run([target, "--version"], capture_output=True, env=clean_env()).returncode == 0
    return target if ok else None  # e.g. a uv built for another libc: pip does the job


def install_packages(python: str, venv: Path, lock: Path, find_links: Path, uv: Path | None, work: Path,
                     log_file: Path, bytecode: bool) -> str:
    """Install the lock into a new venv. bytecode: compile every module now, as pip does by default,
    so users of a read-only PREFIX never recompile at start (most of the time both paths take)."""
    offline = ["--no-index", "--find-links", find_links, "--only-binary", ":all:", "--require-hashes",
               "--no-deps", "-r", lock]  # --no-deps: the lock is the complete set, as in bootstrap.sh
    env = clean_env()
    if uv is not None:
        run([python, "-m", "venv", "--without-pip", venv], "python3 -m venv", log_file, env)
        env["UV_CACHE_DIR"] = str(work / "uv-cache")  # same filesystem as the venv: files are hardlinked
        run([uv, "pip", "install", "--offline", "--no-config", "--python", venv / "bin" / "python",
             *(["--compile-bytecode"] if bytecode else []), *offline], "uv pip install", log_file, env)
        return "uv"
    run([python, "-m", "venv", venv], "python3 -m venv (Debian: apt-get install python3-venv)", log_file, env)
    run([venv / "bin" / "python", "-m", "pip", "install", "--isolated", "--disable-pip-version-check",
         "--no-cache-dir", *([] if bytecode else ["--no-compile"]), *offline], "pip install", log_file, env)
    return "pip"


def self_test(venv: Path, spec: dict, log_file: Path, cwd: Path) -> list[str]:
    """What the profile claims, checked in the new venv before it becomes current."""
    env, done = clean_env(venv), []
    for cmd in spec.get("commands", []):
        exe = venv / "bin" / cmd[0]
        run([exe if exe.exists() else cmd[0], *cmd[1:]], f"self-test `{' '.join(cmd)}`", log_file, env,
            SELF_TEST_TIMEOUT_S, cwd)
        done.append(" ".join(cmd))
    if spec.get("imports"):
        run([venv / "bin" / "python", "-c", "import " + ", ".join(spec["imports"])],
            f"self-test `import {', '.join(spec['imports'])}`", log_file, env, SELF_TEST_TIMEOUT_S, cwd)
        done.append("import " + ", ".join(spec["imports"]))
    doctor = spec.get("doctor")
    if doctor in ("ready", "json"):
        # One `doctor --json` run both checks the claim and leaves the install's doctor report.
        proc = subprocess.run([venv / "bin" / "appliance", "doctor", "--json"], capture_output=True, text=True,
                              env=env, timeout=SELF_TEST_TIMEOUT_S, cwd=cwd)
        with open(log_file, "a") as f:
            f.write(f"$ appliance doctor --json\n{proc.stdout}{proc.stderr}\n(exit {proc.returncode})\n")
        try:  # exit 1 means "problems found", which a profile that does not claim training may have
            report = json.loads(proc.stdout)
            assert proc.returncode in (0, 1) and isinstance(report.get("problems"), list)
        except (ValueError, AssertionError):
            raise Refusal(f"self-test `appliance doctor --json`: exit {proc.returncode}, no valid JSON report "
                          f"(full output: {log_file})") from None
        (venv.parent / "doctor.json").write_text(proc.stdout)
        if doctor == "ready" and (proc.returncode != 0 or not report.get("ready_to_train")):
            raise Refusal(f"self-test `appliance doctor`: not ready to train: {'; '.join(report['problems'])}")
        done.append("appliance doctor: ready to train" if doctor == "ready" else
                    f"appliance doctor --json: valid report, {len(report['problems'])} problem(s)")
    return done


WEIGHTS_PROBE = """
import json, sys
from appliance.assets.weights import find_weights
found = {n: find_weights(n) for n in sys.argv[1:]}
print(json.dumps({n: [str(f.path), f.sha256] for n, f in found.items()}))
"""


def place_weights(root: Path, release_dir: Path, listed: dict[str, str]) -> dict:
    """Move the bundle's weights/ next to the venv; every file index.json names must be one SHA256SUMS
    verified, with the same sha256 (so the index cannot point training at anything unchecked)."""
    index_path = root / "weights" / "index.json"
    if not index_path.exists():
        return {}
    try:
        index = json.loads(read_small(index_path, "weights index"))
        files = {name: (entry["file"], entry["sha256"]) for name, entry in index.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise Refusal(f"weights/index.json: not a weights index ({err})") from None
    for name, (file, digest) in files.items():
        member = f"weights/{file}"
        if "/" in file or member not in listed:
            raise Refusal(f"weights/index.json: {name} names {file}, which is not a file of the bundle")
        if listed[member] != digest:
            raise Refusal(f"weights/index.json: {name}: sha256 {digest[:12]}... differs from SHA256SUMS "
                          f"({listed[member][:12]}...) for {member}")
    shutil.move(root / "weights", release_dir / "weights")
    return index


def place_edge_runner(root: Path, release_dir: Path, entry: dict | None, listed: dict[str, str]) -> dict | None:
    """Move the bundle's edge-runner/ next to the venv (appliance.assets.edge_runner looks there); its run must be
    the file bundle.json names, as SHA256SUMS lists it."""
    if not entry:
        return None
    if entry.get("path") != "edge-runner" or not (root / "edge-runner").is_dir():
        raise Refusal(f"bundle.json: edge runner {entry.get('path')!r} is not the folder edge-runner of the bundle")
    for name in ("run", "runner.json"):
        if f"edge-runner/{name}" not in listed:
            raise Refusal(f"bundle.json: edge runner: edge-runner/{name} is not a file of the bundle")
    if listed["edge-runner/run"] != entry.get("sha256"):
        raise Refusal(f"bundle.json: edge runner: sha256 {str(entry.get('sha256'))[:12]}... differs from "
                      f"SHA256SUMS ({listed['edge-runner/run'][:12]}...)")
    shutil.move(root / "edge-runner", release_dir / "edge-runner")
    return entry


def check_weights(venv: Path, index: dict, log_file: Path, cwd: Path) -> str:
    """The new venv's own lookup (appliance.assets.weights.find_weights) finds and re-hashes every placed file."""
    env = {k: v for k, v in clean_env(venv).items() if k != "APPLIANCE_WEIGHTS_DIR"}
    proc = run([venv / "bin" / "python", "-c", WEIGHTS_PROBE, *index], "self-test `find_weights`", log_file, env,
               SELF_TEST_TIMEOUT_S, cwd)
    found = json.loads(proc.stdout)
    for name, (path, digest) in found.items():
        expected = venv.parent / "weights" / index[name]["file"]
        if Path(path) != expected or digest != index[name]["sha256"]:
            raise Refusal(f"self-test `find_weights`: {name} resolved to {path}, not {expected}")
    return f"pretrained weights found and verified: {', '.join(index)}"


def flip(prefix: Path, link: str, release: str) -> None:
    """Point PREFIX/link at releases/<release> atomically: new symlink under a temp name, then rename."""
    tmp = prefix / f".{link}.tmp-{os.getpid()}"
    tmp.unlink(missing_ok=True)
    os.symlink(f"releases/{release}", tmp)
    os.replace(tmp, prefix / link)
    fd = os.open(prefix, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def linked_release(prefix: Path, link: str) -> str | None:
    try:
        target = os.readlink(prefix / link)
    except OSError:
        return None
    name = Path(target).name
    return name if (prefix / "releases" / name / "install.json").exists() else None


def hold_lock(prefix: Path) -> int:
    """One installer at a time per prefix (released when the process exits)."""
    fd = os.open(prefix / ".install.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


STAGING_IN_USE = ".in-use"


def new_staging(prefix: Path) -> Path:
    """A private (0700) work directory in PREFIX, flocked for as long as this process lives.

    It holds the verified copy from before the install lock is taken, so the stale-directory
    sweep below must tell a live installer's directory from a killed one's: by that flock.
    """
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=prefix))  # mkdtemp: mode 0700, ours
    fd = os.open(staging / STAGING_IN_USE, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)  # kept open (never closed): released when this process ends
    return staging


def remove_stale_staging(prefix: Path, ours: Path) -> None:
    """Remove work directories of killed installers; those of live ones (still copying) hold their flock."""
    for stale in prefix.glob(".staging-*"):
        if stale == ours:
            continue
        try:
            fd = os.open(stale / STAGING_IN_USE, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:  # killed before its flock, or made by an older installer
            if time.time() - stale.lstat().st_mtime < 600:
                continue  # or just created by a live one that is about to take it
        except OSError:
            continue
        else:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            finally:
                os.close(fd)
        shutil.rmtree(stale, ignore_errors=True)


def rollback(prefix: Path) -> int:
    if not prefix.is_dir():
        raise Refusal(f"{prefix}: no previous install to roll back to")
    hold_lock(prefix)
    current, previous = linked_release(prefix, "current"), linked_release(prefix, "previous")
    if previous is None:
        raise Refusal(f"{prefix}: no previous install to roll back to")
    if current:
        flip(prefix, "previous", current)
    flip(prefix, "current", previous)
    log(f"rolled back: current -> releases/{previous} (was releases/{current}; --rollback again returns to it)")
    return 0


def build_release(args, copy, comment: str | None, manifest: dict, name: str,
                  python: str, release_dir: Path, staging: Path, started: float) -> dict:
    """Extract the verified copy, install into release_dir/venv, self-test; return the install.json record."""
    bundle = copy.origin
    profile = manifest["profiles"][name]
    prefix = release_dir.parent.parent
    (staging / "extracted").mkdir()
    root = extract(copy, staging / "extracted")
    copy.discard()  # peak disk: the extracted bundle and the venv, not the copy too
    log(f"extracted {root.name} safely from the verified copy (copy removed)")
    timings = {"verify_and_extract_s": round(time.monotonic() - started, 2)}
    find_links = staging / "find-links"  # only this profile's files: pins never see another profile's
    find_links.mkdir()
    for w in profile["wheels"]:
        os.link(root / w["file"], find_links / Path(w["file"]).name)
    (release_dir / "bundle").mkdir(parents=True)
    listed = {n: d for d, _, n in (line.partition("  ") for line in (root / "SHA256SUMS").read_text().splitlines())}
    # Before the venv (a bad index costs nothing) and the self-test (doctor.json lists them).
    weights = place_weights(root, release_dir, listed)
    # Outside the release, so the output of a failed install outlives its removal.
    log_file = prefix / "logs" / f"install-{release_dir.name}-{time.strftime('%Y%m%dT%H%M%S')}.log"
    log_file.parent.mkdir(exist_ok=True)
    uv = None if args.use == "pip" else uv_binary(root / "wheelhouse", profile["wheels"], staging)
    if args.use == "uv" and uv is None:
        raise Refusal(f"{bundle}: --use uv, but profile {name} carries no runnable uv wheel")
    log(f"installing profile {name} ({len(profile['wheels'])} wheels) into releases/{release_dir.name}/venv "
        f"with {'uv' if uv else 'pip'}, offline")
    t0 = time.monotonic()
    used = install_packages(python, release_dir / "venv", root / profile["lock"], find_links, uv, staging,
                            log_file, bytecode=not args.no_compile)
    timings["install_s"] = round(time.monotonic() - t0, 2)
    for other, data in manifest["profiles"].items():  # carried wheels: edge packages take them from here
        if not data["install"]:
            dest = release_dir / "wheelhouse" / other
            dest.mkdir(parents=True)
            for w in data["wheels"]:
                shutil.move(root / w["file"], dest / Path(w["file"]).name)
    tuning = manifest.get("tuning_databases", [])
    for db in tuning:  # next to the venv: appliance.assets.tuning_db looks there (sys.prefix's parent)
        if not re.fullmatch(r"tuning/[A-Za-z0-9][A-Za-z0-9._-]*", str(db.get("path"))) or not (root / db["path"]).is_dir():
            raise Refusal(f"bundle.json: tuning database {db.get('path')!r} is not a folder tuning/NAME of the bundle")
        dest = release_dir / "tuning" / Path(db["path"]).name
        dest.parent.mkdir(exist_ok=True)
        shutil.move(root / db["path"], dest)
    if tuning:
        names = ", ".join("{} ({}, {})".format(d["name"], d["target"], d["cpu"]) for d in tuning)
        log(f"tuning databases: {names} in releases/{release_dir.name}/tuning")
    runner = place_edge_runner(root, release_dir, manifest.get("edge_runner"), listed)
    if runner:
        log(f"edge runner: {runner['path']}/run (glibc {runner['glibc_floor']}, key {runner['key'][:12]}...) "
            f"in releases/{release_dir.name}/{runner['path']}")
    for f in ("bundle.json", "SHA256SUMS", profile["lock"], profile["sbom"]):
        shutil.copy2(root / f, release_dir / "bundle" / Path(f).name)
    t0 = time.monotonic()
    checks = self_test(release_dir / "venv", profile.get("self_test", {}), log_file, prefix)
    if weights:
        checks.append(check_weights(release_dir / "venv", weights, log_file, prefix))
    timings["self_test_s"] = round(time.monotonic() - t0, 2)
    log("self-test passed: " + "; ".join(checks))
    # bundle_sha256: of the private copy that was verified and extracted, i.e. of what was installed.
    return {"made_by": "installer/install.sh", "bundle": str(bundle), "bundle_sha256": copy.sha256,
            "bundle_bytes": copy.size, "signature": comment, "version": manifest["version"], "profile": name, "installer": used,
            "bytecode_compiled": not args.no_compile, "python": python,
            "installed": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "weights": {n: e["file"] for n, e in weights.items()},
            "self_test": checks, "timings": timings, "log": str(log_file),
            "tuning_databases": [d["name"] for d in tuning],
            "edge_runner": runner["key"] if runner else None}


def check_start(bundle: Path, prefix: Path) -> None:
    """Refuse before anything is copied: BUNDLE not a file, PREFIX writable by all, no room for the copy."""
    if not bundle.is_file():
        raise Refusal(f"{bundle}: " + ("not a regular file (a folder, device or pipe), so not a bundle"
                                       if bundle.exists() else "no such file"))
    prefix.mkdir(parents=True, exist_ok=True)
    if prefix.lstat().st_mode & 0o002:  # a renamed staging or release directory would undo every check
        raise Refusal(f"{prefix}: writable by every user: anyone could change what gets installed "
                      "(chmod o-w it)")
    free, size = shutil.disk_usage(prefix).free, bundle.stat().st_size
    if free < size:
        raise Refusal(f"{prefix}: {free / 1e9:.1f} GB free, the private copy of {bundle.name} alone needs "
                      f"{size / 1e9:.1f} GB")


def keep_current_and_previous(prefix: Path) -> None:
    keep = {linked_release(prefix, "current"), linked_release(prefix, "previous")}
    for old in sorted((prefix / "releases").iterdir()):
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
            log(f"removed old release {old.name} (only current and previous are kept)")


def install(args) -> int:
    bundle, prefix = Path(args.bundle).resolve(), Path(args.prefix).resolve()
    started = time.monotonic()
    created = not prefix.exists()
    check_start(bundle, prefix)
    staging = new_staging(prefix)
    copy, release_dir = None, None
    try:
        # From here on BUNDLE is never opened again: everything reads this copy.
        copy = private_copy(bundle, staging)
        bundle_sha = copy.sha256
        comment = check_signature(copy, args.pubkey, args.allow_unsigned)
        log(f"signature: {'verified, trusted comment: ' + comment if comment else 'NOT CHECKED (--allow-unsigned)'}")
        hold_lock(prefix)
        remove_stale_staging(prefix, staging)

        current = linked_release(prefix, "current")
        if current:
            record = json.loads(read_small(prefix / "releases" / current / "install.json", "install record"))
            if record["bundle_sha256"] == bundle_sha and args.profile in (None, record["profile"]):
                log(f"{bundle.name} (profile {record['profile']}) is already installed and current "
                    f"({prefix / 'current'} -> releases/{current}): nothing to do")
                return 0

        top, manifest = check_sums(copy, staging / "extracted")
        log(f"SHA256SUMS: every file of {top} verified")
        python = args.python or sys.executable
        facts = target_facts(python)
        name = choose_profile(manifest, args.profile, facts, bundle, python)
        try:
            manifest["profiles"][name] = for_python(manifest["profiles"][name], name, facts, python, bundle)
            check_host(manifest["profiles"][name], name, facts, python)
        except Refusal as err:  # say what would fit: the engineer may have carried the wrong bundle
            raise Refusal(f"{err}; the bundle holds {bundle_holds(manifest)}") from None
        refuse_downgrade(prefix, current, manifest["version"], bundle, args.allow_downgrade)
        # Room for the extracted bundle (about the copy's size), then, with the copy deleted once
        # extracted, for an unpacked venv (about 2x its wheels), checked up front.
        need = max(copy.size, 2 * manifest["profiles"][name]["bytes"])
        free = shutil.disk_usage(prefix).free
        if free < need:
            raise Refusal(f"{prefix}: {free / 1e9:.1f} GB free, installing this bundle needs about "
                          f"{need / 1e9:.1f} GB")
        release = f"{manifest['version']}-{bundle_sha[:12]}"
        release_dir = prefix / "releases" / release
        if (release_dir / "install.json").exists():
            log(f"releases/{release} is already installed (a rolled-back install): switching to it")
        else:
            shutil.rmtree(release_dir, ignore_errors=True)  # leftovers of an interrupted install
            record = build_release(args, copy, comment, manifest, name, python, release_dir, staging, started)
            tmp = release_dir / ".install.json.tmp"
            tmp.write_text(json.dumps(record, indent=2) + "\n")
            os.replace(tmp, release_dir / "install.json")  # the release is complete from here on
        if current and current != release:
            flip(prefix, "previous", current)
        flip(prefix, "current", release)
        release_dir = None  # installed: nothing to undo
        keep_current_and_previous(prefix)
        log(f"done in {time.monotonic() - started:.0f} s: {prefix / 'current'} -> releases/{release}; "
            f"run {prefix / 'current' / 'venv' / 'bin' / 'appliance'}")
        return 0
    finally:
        if copy is not None:
            copy.close()
        shutil.rmtree(staging, ignore_errors=True)
        if created:  # refused before the lock: leave no empty PREFIX behind
            try:
                prefix.rmdir()
            except OSError:
                pass
        if release_dir is not None and not (release_dir / "install.json").exists():
            shutil.rmtree(release_dir, ignore_errors=True)
            if (prefix / "releases").exists() and not any((prefix / "releases").iterdir()):
                (prefix / "releases").rmdir()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="install.sh", description="Install an appliance bundle offline.")
    parser.add_argument("bundle", nargs="?", help="appliance-bundle-<version>.tar (signature: BUNDLE.minisig)")
    parser.add_argument("--prefix", required=True, help="install root, e.g. /opt/appliance")
    parser.add_argument("--pubkey", help="minisign public key file (or its base64 line) the bundle must be signed with")
    parser.add_argument("--allow-unsigned", action="store_true", help="install without checking a signature")
    parser.add_argument("--rollback", action="store_true", help="switch back to the previous install")
    parser.add_argument("--allow-downgrade", action="store_true",
                        help="install a bundle whose version is lower than the installed one")
    parser.add_argument("--profile", help="profile to install (default: the one for this machine)")
    parser.add_argument("--python", help="python3 to build the venv with (default: the one running this)")
    parser.add_argument("--use", choices=("auto", "uv", "pip"), default="auto",
                        help="installer: uv from the bundle when it has one (auto), or force one")
    parser.add_argument("--no-compile", action="store_true",
                        help="do not compile bytecode at install (faster install; where PREFIX is read-only "
                        "for users, every start then compiles the modules it imports)")
    args = parser.parse_args(argv)
    try:
        if args.rollback:
            return rollback(Path(args.prefix).resolve())
        if not args.bundle:
            parser.error("BUNDLE is required (or --rollback)")
        return install(args)
    except Refusal as err:
        print(f"refused: {err}", file=sys.stderr)
        return 1
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        # A field of bundle.json (or a record it points to) missing or of another type: signed by its maker
        # or installed --allow-unsigned, it is still no bundle `appliance bundle build` made. One line.
        print(f"refused: {args.bundle}: bundle.json (or a record it names) is not as `appliance bundle build` "
              f"writes it ({type(err).__name__}: {str(err)[:160]})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("install: interrupted; the previous install is untouched", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
