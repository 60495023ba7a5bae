"""`appliance package`: a compiled aarch64 model -> one edge package tar the device installs offline.

The tar holds edge-package/: model.so, model.json (input, preprocessing, class names),
bin/run (native runner, no Python needed) with lib/ (TVM runtime from the aarch64 wheels),
python/run.py + python/preprocessing.py (a verbatim copy of the host's), wheels/ (the hash-locked
aarch64 wheels for the Python runner), reference/model.onnx (what edge verify compares with),
install.sh, SHA256SUMS and manifest.json (lineage back to the training data).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from appliance.errors import DataError, EnvironmentProblem

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parents[1]
ROOT_NAME = "edge-package"
RUNTIME_LIBS = {"apache_tvm-": "tvm/lib/libtvm_runtime.so", "apache_tvm_ffi-": "tvm_ffi/lib/libtvm_ffi.so"}


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "package", help="build an edge package tar (native + Python runners, TVM runtime, wheels, checksums)",
        description="Package COMPILE_DIR (from `appliance compile --target aarch64`) into one tar a device "
        "installs with no network.")
    p.add_argument("compiled", metavar="COMPILE_DIR")
    p.add_argument("--target", default="aarch64", choices=["aarch64"])
    p.add_argument("--out", required=True, metavar="edge-package.tar")
    p.add_argument("--wheelhouse", metavar="DIR",
                   help="aarch64 wheels (default: the project's or installed bundle's wheelhouse/edge-aarch64)")
    p.set_defaults(func=run)


def run(args) -> int:
    info = build_package(args.compiled, args.out, wheelhouse=args.wheelhouse)
    print(f"wrote {args.out} ({info['bytes'] / 1e6:.1f} MB, {info['files']} files, "
          f"{len(info['wheels'])} wheels); check it with `appliance edge verify {args.out}`")
    return 0


def default_wheelhouse() -> Path:
    """The project checkout's wheelhouse, else the one next to the installed bundle's venv."""
    candidates = [PROJECT / "wheelhouse" / "edge-aarch64", Path(sys.prefix).parent / "wheelhouse" / "edge-aarch64"]
    for c in candidates:
        if any(c.glob("apache_tvm-*.whl")):
            return c
    return candidates[0]


def locked_wheels(wheelhouse: Path) -> list[Path]:
    """The wheelhouse's wheels, each checked against the sha256 pins of manifests/edge-aarch64.lock."""
    from appliance.manifest import sha256_file

    wheels = sorted(wheelhouse.glob("*.whl")) if wheelhouse.is_dir() else []
    if not any(w.name.startswith("apache_tvm-") for w in wheels) or not any(
            w.name.startswith("apache_tvm_ffi-") for w in wheels):
        raise EnvironmentProblem(f"{wheelhouse}: no aarch64 apache-tvm/apache-tvm-ffi wheels (run "
                                 "`installer/bootstrap.sh --edge-wheels` on a connected host, or pass --wheelhouse)")
    lock = next((p for p in (PROJECT / "manifests" / "edge-aarch64.lock",
                             wheelhouse.parent.parent / "manifests" / "edge-aarch64.lock") if p.is_file()), None)
    if lock is not None:
        pinned = set(re.findall(r"sha256:([0-9a-f]{64})", lock.read_text()))
        for w in wheels:
            if sha256_file(w) not in pinned:
                raise DataError(f"{w}: sha256 is not pinned in {lock} (a wheel was replaced or added)")
    return wheels


def build_runner(wheels: list[Path], work: Path, lib_dir: Path, out: Path) -> None:
    """Cross-compile runner.cc against the TVM runtime and ffi headers from the aarch64 wheels."""
    from appliance.deploy.compile import check_cross_compiler

    compiler = check_cross_compiler()
    for prefix, member in RUNTIME_LIBS.items():
        wheel = next(w for w in wheels if w.name.startswith(prefix))
        with zipfile.ZipFile(wheel) as z:
            with z.open(member) as src, open(lib_dir / Path(member).name, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if prefix == "apache_tvm_ffi-":
                z.extractall(work, [n for n in z.namelist() if n.startswith("tvm_ffi/include/")])
    cmd = [compiler, "-std=c++17", "-O2", "-I", str(work / "tvm_ffi" / "include"), str(HERE / "edge" / "runner.cc"),
           "-o", str(out), "-L", str(lib_dir), "-ltvm_runtime", "-ltvm_ffi", "-Wl,-rpath,$ORIGIN/../lib"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise EnvironmentProblem(f"{HERE / 'edge' / 'runner.cc'}: cross compile failed: "
                                 f"{(done.stderr.strip().splitlines() or ['?'])[0]}")


def build_package(compiled, out, *, wheelhouse=None) -> dict:
    from appliance.manifest import atomic_write_text, read_manifest, sha256_file, verify_outputs, write_manifest

    compiled, out = Path(compiled), Path(out)
    info_path = compiled / "compile.json"
    if not info_path.is_file():
        raise DataError(f"{compiled}: not a compile directory (no compile.json; run `appliance compile` first)")
    info = json.loads(info_path.read_text())
    if not info["target"].startswith("aarch64"):
        raise DataError(f"{info_path}: compiled for {info['target']}, but edge packages are for aarch64 "
                        "(run `appliance compile --target aarch64`)")
    read_manifest(compiled)
    problems = verify_outputs(compiled)
    if problems:
        raise DataError(f"{compiled}: changed since it was compiled: {problems[0]}")
    wheels = locked_wheels(Path(wheelhouse) if wheelhouse else default_wheelhouse())

    with tempfile.TemporaryDirectory(prefix="edge-package-") as tmp:
        root = Path(tmp) / ROOT_NAME
        for sub in ("bin", "lib", "python", "wheels", "reference"):
            (root / sub).mkdir(parents=True)
        build_runner(wheels, Path(tmp) / "sdk", (root / "lib"), root / "bin" / "run")
        shutil.copyfile(compiled / "model.so", root / "model.so")
        shutil.copyfile(compiled / "model.onnx", root / "reference" / "model.onnx")
        # Copied, not rewritten: the device must preprocess exactly as the host measured.
        from data_tools import preprocessing

        shutil.copyfile(preprocessing.__file__, root / "python" / "preprocessing.py")
        shutil.copyfile(HERE / "edge" / "run.py", root / "python" / "run.py")
        shutil.copyfile(HERE / "edge" / "install.sh", root / "install.sh")
        (root / "install.sh").chmod(0o755)
        for w in wheels:
            shutil.copyfile(w, root / "wheels" / w.name)
        model_info = {"made_by": "appliance package", "target": info["target"], "tvm_target": info["tvm_target"],
                      "input": info["input"], "precision": info.get("precision", "fp32"),
                      "preprocessing": info.get("preprocessing"),
                      "class_names": info.get("class_names", []), "model_card": info.get("model_card")}
        atomic_write_text(root / "model.json", json.dumps(model_info, indent=2) + "\n")
        files = sorted(p for p in root.rglob("*") if p.is_file())
        atomic_write_text(root / "SHA256SUMS", "".join(
            f"{sha256_file(p)}  {p.relative_to(root)}\n" for p in files))
        write_manifest(root, "package", [compiled / "model.so", info_path, compiled / "model.onnx", *wheels],
                       {"target": info["target"], "wheels": [w.name for w in wheels]})
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(root, arcname=ROOT_NAME)
        partial.replace(out)
        return {"bytes": out.stat().st_size, "files": len(files) + 2, "wheels": [w.name for w in wheels]}
