"""An aarch64 Python to run the package's Python runner under qemu, never installed on the host.

`appliance edge sysroot --out DIR` (on a connected host) fetches Debian arm64 .debs of
python3.11 and its dependencies with `apt-get` under a private configuration (its own
architecture, state, cache and lists directories: the host's dpkg database is never touched)
into DIR with a manifest.json; DIR can travel in the bundle. `edge verify --python` then
unpacks them with `dpkg -x` into a throwaway sysroot, unpacks the package's own wheels next to
it, and runs python/run.py under qemu-aarch64.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import zipfile
from pathlib import Path

from appliance import beside_venv
from appliance.deploy.edge.cycles import arm_cpu_files
from appliance.deploy.edge.qemu import find_qemu, run_counting_samples, run_json
from appliance.core.errors import DataError, EnvironmentProblem
from appliance.core.manifest import check_outputs, write_manifest

PACKAGES = ("python3.11", "libstdc++6")  # numpy's and TVM's wheels expect the system libstdc++
MIRROR, SUITE = "http://deb.debian.org/debian", "bookworm"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
ORT_RUNNER_WHEELS = ("onnxruntime-", "protobuf-", "flatbuffers-")  # a package whose runtime is onnxruntime
RUNNER_WHEELS = ("apache_tvm-", "apache_tvm_ffi-", "numpy-", "ml_dtypes-", "pillow-", "typing_extensions-",
                 "packaging-")
PROJECT = Path(__file__).resolve().parents[3]


def default_debs_dir() -> Path:
    for c in (PROJECT / "wheelhouse" / "edge-sysroot-arm64", *beside_venv("wheelhouse/edge-sysroot-arm64")):
        if (c / "manifest.json").is_file():
            return c
    return PROJECT / "wheelhouse" / "edge-sysroot-arm64"


def fetch_sysroot_debs(out_dir, *, mirror=MIRROR, suite=SUITE) -> list[Path]:
    if shutil.which("apt-get") is None:
        raise EnvironmentProblem("apt-get: not found (fetching the arm64 sysroot needs a Debian host)")
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(prefix="apt-arm64-") as tmp:
        apt = Path(tmp)
        for d in ("state/lists/partial", "cache/archives/partial", "etc/sources.list.d", "etc/preferences.d",
                  "etc/apt.conf.d"):
            (apt / d).mkdir(parents=True)
        (apt / "state" / "status").touch()
        (apt / "etc" / "sources.list").write_text(f"deb [arch=arm64 signed-by={KEYRING}] {mirror} {suite} main\n")
        (apt / "apt.conf").write_text("".join(f'{key} "{value}";\n' for key, value in {
            "APT::Architecture": "arm64", "Dir::State": apt / "state", "Dir::State::status": apt / "state" / "status",
            "Dir::Cache": apt / "cache", "Dir::Etc::SourceList": apt / "etc" / "sources.list",
            "Dir::Etc::SourceParts": apt / "etc" / "sources.list.d", "Dir::Etc::Preferences": apt / "etc" / "preferences",
            "Dir::Etc::PreferencesParts": apt / "etc" / "preferences.d", "Dir::Etc::Parts": apt / "etc" / "apt.conf.d",
        }.items()) + 'APT::Architectures { "arm64"; };\n'
            # Our private directories are not readable by the _apt sandbox user.
            + ('APT::Sandbox::User "root";\n' if os.geteuid() == 0 else ""))
        env = {**os.environ, "APT_CONFIG": str(apt / "apt.conf"), "DEBIAN_FRONTEND": "noninteractive"}
        for cmd in (["apt-get", "update", "-q"],
                    ["apt-get", "install", "--download-only", "-y", "-q", "--no-install-recommends", *PACKAGES]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if done.returncode != 0:
                errors = [line for line in (done.stderr + done.stdout).splitlines() if line.startswith(("E:", "W:", "Err"))]
                raise EnvironmentProblem(f"{mirror}: `{' '.join(cmd[:2])}` failed ({(errors or ['?'])[0]}); "
                                         "fetching the sysroot needs a connected host")
            if cmd[1] == "update" and not list((apt / "state" / "lists").glob("*Packages*")):
                # apt-get update exits 0 when every download failed; the lists tell the truth.
                warnings = [line for line in (done.stderr + done.stdout).splitlines() if line.startswith(("W:", "Err"))]
                raise EnvironmentProblem(f"{mirror}: no package lists downloaded ({(warnings or ['?'])[0]}); "
                                         "fetching the sysroot needs a connected host")
        debs = sorted((apt / "cache" / "archives").glob("*.deb"))
        out_dir.mkdir(parents=True, exist_ok=True)
        for old in out_dir.glob("*.deb"):
            old.unlink()
        for deb in debs:
            shutil.copyfile(deb, out_dir / deb.name)
    kept = sorted(out_dir.glob("*.deb"))
    write_manifest(out_dir, "edge-sysroot", [], {"packages": list(PACKAGES), "mirror": mirror, "suite": suite,
                                                 "architecture": "arm64"})
    return kept


def build_python_sysroot(debs_dir, package_root: Path, into: Path) -> tuple[Path, Path]:
    """(sysroot, site): the checked .debs extracted with dpkg -x, the package's wheels unpacked."""
    debs_dir = Path(debs_dir)
    if not (debs_dir / "manifest.json").is_file():
        raise EnvironmentProblem(f"{debs_dir}: no arm64 sysroot .debs (run `appliance edge sysroot --out {debs_dir}` "
                                 "on a connected host, or pass --sysroot-debs)")
    check_outputs(debs_dir)
    if shutil.which("dpkg") is None:
        raise EnvironmentProblem("dpkg: not found (needed to extract the arm64 .debs)")
    sysroot, site = into / "sysroot", into / "site"
    site.mkdir(parents=True)
    for deb in sorted(debs_dir.glob("*.deb")):
        subprocess.run(["dpkg", "-x", str(deb), str(sysroot)], check=True)
    wheels = sorted((package_root / "wheels").glob("*.whl"))
    onnxruntime = any(w.name.startswith("onnxruntime-") for w in wheels)
    for prefix in RUNNER_WHEELS + (ORT_RUNNER_WHEELS if onnxruntime else ()):
        wheel = next((w for w in wheels if w.name.startswith(prefix)), None)
        if wheel is None:
            raise DataError(f"{package_root / 'wheels'}: no {prefix.rstrip('-')} wheel in the package")
        with zipfile.ZipFile(wheel) as z:
            # The compiler library (240 MB) is not needed with TVM_USE_RUNTIME_LIB=1.
            z.extractall(site, [n for n in z.namelist() if not n.endswith("libtvm_compiler.so")])
    if onnxruntime:
        arm_cpu_files(sysroot)
    return sysroot, site


def run_python_runner(root: Path, sysroot: Path, site: Path, inputs: Path, outputs: Path, total: int) -> None:
    python = sysroot / "usr" / "bin" / "python3.11"
    if not python.exists():
        raise DataError(f"{sysroot}: the arm64 .debs hold no usr/bin/python3.11")
    env = {**os.environ, "PYTHONPATH": str(site), "TVM_USE_RUNTIME_LIB": "1"}
    returncode, stderr = run_counting_samples(
        [find_qemu(), "-L", str(sysroot), str(python), "-s",
         str(root / "python" / "run.py"), "--input", str(inputs), "--output", str(outputs), "--top-k", "1"],
        total, "Python runner", env=env)
    if returncode != 0:
        tail = (stderr.strip().splitlines() or ["no output"])[-1]
        raise DataError(f"{root / 'python' / 'run.py'}: Python runner failed under qemu (exit {returncode}): {tail}")


def run_python_selftest(root: Path, sysroot: Path, site: Path) -> dict:
    """`python/run.py --selftest` under qemu: the golden samples on the runtime model.json names."""
    env = {**os.environ, "PYTHONPATH": str(site), "TVM_USE_RUNTIME_LIB": "1"}
    _, result = run_json([find_qemu(), "-L", str(sysroot), str(sysroot / "usr" / "bin" / "python3.11"), "-s",
                          str(root / "python" / "run.py"), "--selftest"], f"{root / 'python' / 'run.py'} --selftest",
                         env=env)
    return result
