"""The edge package's native runner (bin/run): its zig build, its key, and the prebuilt one a bundle carries.

zig keys its libc++ build by the path of its install, so the first build in every new venv spends
1-2.5 minutes on it. The runner does not depend on the model, only on what `runner_inputs` hashes:
runner.cc and the headers it includes (signature.h, hashes.h, class_map_png.h), the tvm-ffi headers,
libtvm_runtime.so and libtvm_ffi.so from the edge wheels, the glibc floor, zig's version and the
compile argv. `appliance bundle build` builds it once on the connected
host into edge-runner/ (run + runner.json); the installer puts that folder next to the venv, and
`appliance package` copies it when its key is the key of what it would build.
Core, not deploy: the bundle builder (which may not import deploy) makes it with the same function.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from appliance import beside_venv
from appliance.core.errors import EnvironmentProblem
from appliance.core.manifest import sha256_file

RUNNER_SOURCE = Path(__file__).resolve().parents[1] / "deploy" / "edge" / "runner.cc"
RUNNER_HEADERS = ("signature.h", "hashes.h", "class_map_png.h", "cores.h", "detection_decode.h")  # beside runner.cc, included by it: the device-side verifier, the PNG writer, the core placement, detection decoding
RUNTIME_LIBS = {"apache_tvm-": "tvm/lib/libtvm_runtime.so", "apache_tvm_ffi-": "tvm_ffi/lib/libtvm_ffi.so"}
HEADERS = "tvm_ffi/include"  # under the sdk folder extract_runtime fills
DEFAULT_GLIBC_FLOOR = "2.28"
CARRIED = "edge-runner"  # the bundle's folder, and the one next to an installed venv
CARRIED_ENV = "APPLIANCE_EDGE_RUNNER_DIR"
RUNNER_JSON = "runner.json"


def carried_dirs() -> list[Path]:
    """Where a prebuilt runner is looked for: $APPLIANCE_EDGE_RUNNER_DIR, then edge-runner/ next to the venv."""
    return beside_venv(CARRIED, CARRIED_ENV)


def wheel_of(wheels: list[Path], prefix: str) -> Path:
    return next(w for w in wheels if w.name.startswith(prefix))


def extract_runtime(wheels: list[Path], sdk: Path, lib_dir: Path) -> None:
    """libtvm_runtime.so and libtvm_ffi.so into lib_dir, the tvm-ffi headers into sdk."""
    for prefix, member in RUNTIME_LIBS.items():
        with zipfile.ZipFile(wheel_of(wheels, prefix)) as z:
            with z.open(member) as src, open(lib_dir / Path(member).name, "wb") as dst:
                shutil.copyfileobj(src, dst)
            if prefix == "apache_tvm_ffi-":
                z.extractall(sdk, [n for n in z.namelist() if n.startswith(HEADERS + "/")])


def zig_command() -> list[str]:
    """zig's C++ driver from the ziglang wheel: it links against a chosen glibc version's symbols,
    where Debian's aarch64 g++ links against its own glibc 2.36 (every binary then needs 2.34)."""
    if importlib.util.find_spec("ziglang") is None:
        raise EnvironmentProblem("ziglang: not installed in this Python (it cross-compiles bin/run for an old "
                                 "glibc; `pip install --no-deps ziglang==0.17.0` from the bundle's wheelhouse)")
    return [sys.executable, "-m", "ziglang", "c++"]


def zig_version() -> str:
    """The ziglang wheel's version, read from its metadata (zig itself is not run)."""
    try:
        return importlib.metadata.version("ziglang")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def compile_argv(glibc_floor: str, include: str, source: str, out: str, lib_dir: str) -> list[str]:
    """zig c++'s arguments after the driver; the key hashes them with placeholders for the four paths."""
    return ["-target", f"aarch64-linux-gnu.{glibc_floor}", "-std=c++17", "-O2",
            # C ABI only: zig's libc++ must export nothing that replaces libtvm_ffi's own classes.
            "-DTVM_FFI_DLL=", "-fvisibility=hidden", "-fvisibility-inlines-hidden", "-fno-exceptions",
            "-I", include, source, "-o", out, "-L", lib_dir,
            # The runner calls nothing in libtvm_runtime directly, but its VM functions must be registered.
            "-Wl,--no-as-needed", "-ltvm_runtime", "-ltvm_ffi", "-Wl,--as-needed", "-Wl,-rpath,$ORIGIN/../lib", "-s"]


def runner_inputs(sdk: Path, lib_dir: Path, glibc_floor: str, source: Path = RUNNER_SOURCE) -> dict:
    """Everything bin/run is made from, hashed: two runners with equal inputs are interchangeable."""
    headers = sdk / HEADERS
    return {"runner.cc": sha256_file(source),
            **{name: sha256_file(source.parent / name) for name in RUNNER_HEADERS},
            "headers": {str(p.relative_to(headers)): sha256_file(p) for p in sorted(headers.rglob("*")) if p.is_file()},
            "libraries": {Path(m).name: sha256_file(lib_dir / Path(m).name) for m in RUNTIME_LIBS.values()},
            "glibc_floor": glibc_floor, "zig": zig_version(),
            "argv": compile_argv(glibc_floor, "<include>", "<runner.cc>", "<out>", "<lib>")}


def runner_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


def build_runner(sdk: Path, lib_dir: Path, out: Path, glibc_floor: str, source: Path = RUNNER_SOURCE) -> None:
    """Cross-compile runner.cc against the tvm-ffi C headers and the TVM runtime libraries."""
    cmd = [*zig_command(), *compile_argv(glibc_floor, str(sdk / HEADERS), str(source), str(out), str(lib_dir))]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        raise EnvironmentProblem(f"{source}: zig c++ ran past 900 s") from None
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "error" in line] or done.stderr.splitlines() or ["?"]
        raise EnvironmentProblem(f"{source}: cross compile with zig failed: {errors[0].strip()}")


def build_carried(wheels: list[Path], into: Path, work: Path, glibc_floor: str = DEFAULT_GLIBC_FLOOR,
                  source: Path = RUNNER_SOURCE) -> dict:
    """into/run and into/runner.json, built from the edge wheels (for a bundle; source: the runner.cc of the
    checkout whose wheel it carries); returns runner.json's content."""
    sdk, lib_dir = work / "sdk", work / "lib"
    sdk.mkdir(parents=True)
    lib_dir.mkdir()
    into.mkdir(parents=True)
    extract_runtime(wheels, sdk, lib_dir)
    inputs = runner_inputs(sdk, lib_dir, glibc_floor, source)
    build_runner(sdk, lib_dir, into / "run", glibc_floor, source)
    record = {"made_by": "appliance bundle build", "key": runner_key(inputs), "glibc_floor": glibc_floor,
              "zig": inputs["zig"], "sha256": sha256_file(into / "run"),
              "wheels": {prefix.rstrip("-"): wheel_of(wheels, prefix).name for prefix in RUNTIME_LIBS},
              "inputs": inputs}
    (into / RUNNER_JSON).write_text(json.dumps(record, indent=2) + "\n")
    return record


def find_carried(inputs: dict) -> tuple[Path | None, str]:
    """(the carried run whose key is the key of inputs, or None; the one line that says what bin/run will be).

    A carried runner that is unreadable, altered or made from other inputs is passed over, never an error."""
    key = runner_key(inputs)
    passed_over = []
    for directory in carried_dirs():
        if not (directory / RUNNER_JSON).exists() and not (directory / "run").exists():
            continue
        try:
            record = json.loads((directory / RUNNER_JSON).read_text())
            carried_key, carried_inputs = record["key"], record.get("inputs") or {}
            digest = record["sha256"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            passed_over.append(f"{directory / RUNNER_JSON} is unreadable ({type(err).__name__}: {err})")
            continue
        if carried_key != key:
            differs = [name for name in inputs if carried_inputs.get(name) != inputs[name]]
            said = ", ".join(f"{d} {carried_inputs.get(d)} vs {inputs[d]}" if d in ("glibc_floor", "zig") else d
                             for d in differs) or "runner.json edited"
            passed_over.append(f"{directory}'s key {str(carried_key)[:12]}... is not this package's ({said})")
            continue
        if not (directory / "run").is_file() or sha256_file(directory / "run") != digest:
            passed_over.append(f"{directory / 'run'} is missing or not the file runner.json names")
            continue
        return directory / "run", f"bin/run: the bundle's prebuilt runner (key {key[:12]}...)"
    why = "; ".join(passed_over) or f"no prebuilt runner in {', '.join(map(str, carried_dirs()))}"
    return None, f"bin/run: built with zig (key {key[:12]}...): {why}"
