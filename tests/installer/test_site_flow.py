"""The whole site flow in one go, offline: build the CPU site's bundle, install it under
`unshare -n` into a fresh prefix, and run `appliance demo` from the installed venv under
`unshare -n` (loopback up for torchrun), from a clean shell outside this checkout.

The bundle is built from wheelhouse/trainer-cpu and wheelhouse/edge-aarch64 (fetched on a
connected host by `installer/bootstrap.sh --site-wheels --edge-wheels`) with pip's index turned
off, so no step of this test reaches the network. The demo's figures are checked against the bars
the run itself set (its gate, its pipeline.toml), above a sanity floor far over chance.
"""

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

import bundle_kit
from appliance.bundle.profiles import load_profiles
from appliance.core.stage import figures_under
from appliance.pipeline.runner import STAGES
from conftest import ROOT, VENV_BIN, offline_cmd
from data_tools.tfrecord import read_records

pytestmark = pytest.mark.slow

SITE = "trainer-cpu"  # what a CPU training site installs
CARRIED = "edge-aarch64"  # what its edge packages take their aarch64 wheels from
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# Ten balanced classes: chance is 0.1. Far below what the demo reaches, far above a broken model.
SANITY_FLOOR = 0.8
# A quicker demo (12 epochs in the config): every stage still runs, the gates still judge it.
DEMO_EPOCHS = "3"


def fetched_wheelhouse(profile: str) -> Path:
    """wheelhouse/PROFILE as bootstrap left it, complete for the profile's current lock."""
    lock = ROOT / "manifests" / f"{profile}.lock"
    dest = ROOT / "wheelhouse" / profile
    stamp = dest / ".lock-sha256"
    flag = "--site-wheels" if profile == SITE else "--edge-wheels"
    if not stamp.is_file() or stamp.read_text().strip() != hashlib.sha256(lock.read_bytes()).hexdigest():
        pytest.fail(f"{dest}: not fetched for {lock.name} (run installer/bootstrap.sh {flag} on a connected host)")
    return dest.resolve()


def clean_env(home: Path) -> dict:
    """A login shell's environment on the site: no PYTHONPATH, no venv on PATH, a fresh HOME.

    Sharing this user's ~/.cache/zig would not save a zig build's ~2.5 min: zig keys its libc++ build
    by the path of its install, which is new for every release (the bundle's prebuilt runner saves it)."""
    return {"HOME": str(home), "PATH": SYSTEM_PATH, "LANG": "C.UTF-8", "TMPDIR": str(home)}


def site_python() -> str:
    """The interpreter a site has: the system's python3.11 (Debian 12: 3.11.2), else the tests' own."""
    return shutil.which("python3.11", path=SYSTEM_PATH) or bundle_kit.BASE_PYTHON


def timed(cmd: list[str], **kw) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, **kw)
    return proc, time.monotonic() - started


def test_site_profile_is_the_cpu_training_host():
    site = load_profiles(ROOT / "manifests")[SITE]
    carried = load_profiles(ROOT / "manifests")[CARRIED]
    assert site.install and site.project and site.cuda_major is None and site.arch == "x86_64"
    assert site.self_test["doctor"] == "ready"  # the install itself claims the host can train
    assert not carried.install and carried.arch == "aarch64"


@pytest.fixture
def site_dir(tmp_path):
    """tmp_path, less the 3.5 GB bundle and the 7 GB venv afterwards: pytest keeps a failed run's
    tmp_path for reading, and the logs are what is worth reading there."""
    yield tmp_path
    shutil.rmtree(tmp_path / "bundle", ignore_errors=True)
    shutil.rmtree(tmp_path / "opt-appliance" / "releases", ignore_errors=True)
    shutil.rmtree(tmp_path / "home", ignore_errors=True)


@pytest.mark.disk_heavy
def test_bundle_installed_offline_runs_the_demo_offline(site_dir):
    tmp_path = site_dir
    timings = {}
    profiles = load_profiles(ROOT / "manifests")
    # 1. Build the site's bundle from the fetched wheelhouses, pip's index off, in a namespace with no network.
    cache = tmp_path / "cache"
    cache.mkdir()
    for name in (SITE, CARRIED):  # the builder's per-platform download directory is the fetched wheelhouse
        (cache / profiles[name].platform).symlink_to(fetched_wheelhouse(name))
    key, pub = bundle_kit.keys(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env |= {"PIP_CONFIG_FILE": os.devnull, "PIP_NO_INDEX": "1",
            "PIP_FIND_LINKS": " ".join(str(p) for p in sorted(cache.iterdir()))}
    proc, timings["bundle build"] = timed(offline_cmd(
        [str(VENV_BIN / "appliance"), "bundle", "build", "--profile", SITE, "--profile", CARRIED,
         "--out", str(tmp_path / "bundle"), "--cache", str(cache), "--sign-key", str(key), "--source", str(ROOT)]),
        env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tar,) = (tmp_path / "bundle").glob("appliance-bundle-*.tar")
    version = tar.name.removeprefix("appliance-bundle-").removesuffix(".tar")

    # 2. Install it offline into a fresh prefix, as the site's engineer does.
    prefix = tmp_path / "opt-appliance"
    started = time.monotonic()
    proc = bundle_kit.install(tar, prefix, pubkey=pub, python=site_python())
    timings["install"] = time.monotonic() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "signature: verified" in proc.stderr and f"installing profile {SITE} " in proc.stderr
    assert "appliance doctor: ready to train" in proc.stderr
    shutil.rmtree(tmp_path / "bundle")  # installed: the carried tar (3.5 GB) is no longer needed
    appliance = prefix / "current" / "venv" / "bin" / "appliance"

    # 3. The demo from the installed venv only: a clean shell, cwd outside the checkout, no network but loopback.
    home, work = tmp_path / "home", tmp_path / "site"
    home.mkdir()
    work.mkdir()
    where = subprocess.run([str(prefix / "current" / "venv" / "bin" / "python"), "-c",
                            "import appliance, data_tools, sys; print(appliance.__file__, data_tools.__file__); "
                            "print(*sys.path, sep='\\n')"],
                           capture_output=True, text=True, env=clean_env(home), cwd=work)
    assert where.returncode == 0, where.stderr
    assert str(ROOT) not in where.stdout and str(ROOT.resolve()) not in where.stdout, where.stdout
    assert all(p.startswith(str(prefix.resolve())) for p in where.stdout.split()[:2]), where.stdout
    out = work / "appliance-demo"
    demo = [str(appliance), "demo", "--out", str(out), "--epochs", DEMO_EPOCHS]
    proc, timings["demo"] = timed(offline_cmd(demo, loopback=True),
                                  env=clean_env(home), cwd=work, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    package_s = re.search(r"package: done in ([0-9.]+) s", proc.stdout + proc.stderr)
    timings["demo package stage"] = float(package_s.group(1)) if package_s else float("nan")
    print("site flow seconds:", json.dumps({k: round(v, 1) for k, v in timings.items()}))

    # Every stage ran, from the installed code: the manifests name its version and no git checkout.
    config = tomllib.loads((out / "pipeline.toml").read_text())
    ran = [s for s in STAGES if s != "tune" or config.get("pipeline", {}).get("tune")]  # tune runs when asked
    stage_dirs = [f"compile-{t}" if s == "compile" else s for s in ran
                  for t in (config["compile"]["targets"] if s == "compile" else [None])]
    assert config["train"]["epochs"] == int(DEMO_EPOCHS)
    made_by = shlex.join(["appliance", *demo[1:]])
    for stage in stage_dirs:
        manifest = json.loads((out / "out" / stage / "manifest.json").read_text())
        assert manifest["appliance_version"] == version and "git" not in manifest, (stage, manifest)
        assert manifest["command"] == made_by, (stage, manifest["command"])

    # The figures, against the bars this run set for itself.
    summary = json.loads((out / "out" / "summary.json").read_text())
    acc = summary["accuracy"]
    assert summary["quality_gate"]["passed"], summary["quality_gate"]
    assert acc["fp32_top1"] >= acc["quality_gate_required_top1"] > acc["val_majority_baseline_top1"], acc
    assert acc["fp32_top1"] >= SANITY_FLOOR, acc
    mode = config["quantize"]["mode"]
    assert acc["quantized_top1_drop_points"] <= config["quantize"]["max_drop"], acc
    assert acc[f"{mode}_top1"] >= SANITY_FLOOR, acc
    assert acc["edge_agreement_with_host"] >= config["verify"]["min_agreement"], acc
    # samples = 0: the edge package ran on the whole validation split under qemu-aarch64.
    assert config["verify"]["samples"] == 0
    val_records = sum(1 for f in sorted((out / "data").glob("val-*.tfrecord")) for _ in read_records(f))
    assert val_records >= 300 and summary["verified_samples"] == val_records, (val_records, summary["verified_samples"])
    assert summary.get("edge_selftest", {"passed": True})["passed"], summary["edge_selftest"]
    # The package's TVM runtime came from the aarch64 wheels the bundle carried into the release.
    assert prefix.joinpath("current", "wheelhouse", CARRIED).is_dir()
    package = summary["stages"]["package"]  # flat figures (appliance/core/stage.py): nested parts are dotted keys
    # (a file name's own dots make the dotted key ambiguous to figures_under: read the flat key itself)
    assert any(k.startswith("elf_needs.lib/libtvm_runtime.so.") for k in package), package
    # Its bin/run is the runner the bundle built on the connected host (no zig run on the site), placed next
    # to the venv by the installer, listed in SHA256SUMS and the SBOM.
    record = json.loads((prefix / "current" / "install.json").read_text())
    carried = json.loads((prefix / "current" / "bundle" / "bundle.json").read_text())["edge_runner"]
    assert record["edge_runner"] == carried["key"] and carried["glibc_floor"] == "2.28"
    sums = (prefix / "current" / "bundle" / "SHA256SUMS").read_text()
    assert f"{carried['sha256']}  edge-runner/run\n" in sums
    assert hashlib.sha256((prefix / "current" / "edge-runner" / "run").read_bytes()).hexdigest() == carried["sha256"]
    sbom = json.loads(next((prefix / "current" / "bundle").glob("sbom.cdx.json")).read_text())
    assert any(c["name"] == "appliance-edge-runner" and c["hashes"][0]["content"] == carried["sha256"]
               for c in sbom["components"])
    assert figures_under(package, "runner") == {"source": "bundle", "key": carried["key"]}
    assert f"bin/run: the bundle's prebuilt runner (key {carried['key'][:12]}...)" in proc.stderr
    print("site flow demo figures:", json.dumps(acc))
