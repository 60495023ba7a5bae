"""`appliance package`: a compiled aarch64 model -> one edge package tar the device installs offline.

The tar holds edge-package/: model.so, model.json (input, preprocessing, class names, glibc
floor, self-test tolerance), bin/run (native runner, no Python needed) with lib/ (TVM runtime
from the aarch64 wheels), selftest/ (golden inputs: real validation samples, preprocessed, and
the host's outputs for them), reference/model.onnx (what edge verify compares with), install.sh,
manifest.json (lineage back to the training data), signing-key.pub, SHA256SUMS over all of it and
SHA256SUMS.minisig: SHA256SUMS signed with the site's edge key (appliance.deploy.edge.signing).
`--with-python` adds python/run.py + python/preprocessing.py (a verbatim copy of the host's) and
wheels/ (the hash-locked aarch64 wheels that runner needs, with a --require-hashes list).

bin/run is the installed bundle's prebuilt runner when its key (appliance.assets.edge_runner) is the key of
what this package would build, else it is cross-compiled with zig; the manifest's `runner` says which.

Every ELF file in it is read for the glibc symbol versions it needs; anything above the floor
(`--glibc-floor`, default 2.28) is refused, so that the package starts on the devices it names.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from appliance import beside_venv
from appliance.deploy.edge.sysroot import RUNNER_WHEELS  # what python/run.py imports
from appliance.deploy.edge.glibc_floor import DEFAULT_GLIBC_FLOOR, check_floor, parse_floor, version_key
from appliance.deploy.edge.signing import CARRIED_PUB, sign_sums, site_key
from appliance.assets.edge_runner import (RUNTIME_LIBS, build_runner, extract_runtime, find_carried, runner_inputs,
                                   runner_key, wheel_of)
from appliance.core.errors import DataError, EnvironmentProblem
from appliance.core.manifest import sha256_file, read_manifest, atomic_write_text, check_outputs, write_manifest
from appliance.core.stage import read_result_json
from appliance.core.progress import quiet
from appliance.deploy.samples import check_input_shape, load_samples, synthetic_samples
from appliance.deploy.tolerance import qdq_allowance
from appliance.deploy.onnx_model import default_tolerance, ort_session, run_ort
from data_tools import preprocessing
from appliance.core.stage import read_result_json
from appliance.tasks import task_of_metadata

PACKAGE_RESULT_JSON = "package.json"

HERE = Path(__file__).resolve().parent
PROJECT = HERE.parents[1]
ROOT_NAME = "edge-package"
GOLDEN_SAMPLES = 8


def default_wheelhouse() -> Path:
    """The project checkout's wheelhouse, else the one next to the installed bundle's venv."""
    candidates = [PROJECT / "wheelhouse" / "edge-aarch64", *beside_venv("wheelhouse/edge-aarch64")]
    for c in candidates:
        if any(c.glob("apache_tvm-*.whl")):
            return c
    return candidates[0]


def locked_wheels(wheelhouse: Path) -> list[Path]:
    """The wheelhouse's wheels, each checked against the sha256 pins of manifests/edge-aarch64.lock."""
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


def ship_runner(sdk: Path, lib_dir: Path, out: Path, glibc_floor: str) -> dict:
    """bin/run: the installed bundle's prebuilt runner when its key is this package's, else built with zig
    (the first build in a new venv: minutes). Says which in one line; returns the manifest's `runner`."""
    inputs = runner_inputs(sdk, lib_dir, glibc_floor)
    carried, line = find_carried(inputs)
    if not quiet():
        print(line, file=sys.stderr, flush=True)
    if carried is None:
        build_runner(sdk, lib_dir, out, glibc_floor)
    else:
        shutil.copyfile(carried, out)
        out.chmod(0o755)
    return {"source": "built" if carried is None else "bundle", "key": runner_key(inputs)}


def golden_samples(compiled: Path, sample_files, preprocessing: dict, shape: list, count: int):
    """Real validation samples for the self-test: those given, else the ones export checked parity on
    (from the lineage, when the files are still there unchanged), else seeded synthetic images."""
    if sample_files:
        return load_samples(sample_files, preprocessing, limit=count)
    manifest = read_manifest(compiled)
    for step in manifest.get("lineage") or manifest.get("params", {}).get("lineage", []):
        if step["stage"] != "export":
            continue
        # Its inputs are the trained model's files (weights, card) and then the samples.
        files = [Path(i["path"]) for i in step["inputs"] if Path(i["path"]).suffix not in (".safetensors", ".json")]
        unchanged = [i for i in step["inputs"] if Path(i["path"]) in files and Path(i["path"]).is_file()
                     and sha256_file(i["path"]) == i["sha256"]]
        if files and len(unchanged) == len(files):
            try:
                return load_samples(files, preprocessing, limit=count)
            except DataError:
                break  # not image samples after all: fall back to synthetic ones
    return synthetic_samples(preprocessing, shape[1], count, shape, compiled / "compile.json")


def write_selftest(root: Path, samples, reference: Path, precision: str, count: int, task=None) -> dict:
    """selftest/inputs.npy and the host's outputs for them; returns the model.json entry. A segmentation
    model also gets the host's golden class maps, selftest/masks.npy (uint8 N x H x W), which the device's
    class maps must match on the task's min_agreement of the pixels.

    Of the candidate samples, those whose top-1 logit leads the runner-up by more than twice the
    allowed difference (at every pixel) come first: on them, any output within tolerance has the
    same top-1, so the device's agreement gate cannot trip on a near tie."""
    import numpy as np

    host = run_ort(ort_session(reference, optimize=False), samples.x).astype(np.float32)
    if task is not None and task.kind == "detection":  # bin/run compares each sample's raw outputs flat
        host = host.reshape(len(host), -1)
    tolerance = default_tolerance(precision)
    # A QDQ model's int8 build may differ from the float reference by the output steps compile allows.
    allowed = max(tolerance * max(1.0, float(np.abs(host).max())), qdq_allowance(reference))
    top2 = np.sort(host, axis=1)[:, -2:] if host.shape[1] > 1 else np.zeros((len(host), 2, *host.shape[2:]), np.float32)
    margin = (top2[:, 1] - top2[:, 0]).reshape(len(host), -1).min(1)  # a segmentation sample's closest pixel
    clear = [i for i in range(len(host)) if margin[i] > 2 * allowed]
    rest = sorted(set(range(len(host))) - set(clear), key=lambda i: -margin[i])
    chosen = sorted((clear + rest)[:count])
    (root / "selftest").mkdir()
    np.save(root / "selftest" / "inputs.npy", np.ascontiguousarray(samples.x[chosen], dtype=np.float32))
    np.save(root / "selftest" / "expected.npy", host[chosen])
    entry = {"inputs": "selftest/inputs.npy", "expected": "selftest/expected.npy", "samples": len(chosen),
             "source": samples.source, "files": [str(f) for f in samples.files], "reference": "onnxruntime (host)",
             "tolerance": tolerance, "max_abs_diff": allowed, "min_top1_agreement": 1.0,
             "min_top1_margin": float(margin[chosen].min())}
    if task is not None and task.kind == "segmentation":
        np.save(root / "selftest" / "masks.npy", host[chosen].argmax(1).astype(np.uint8))
        del entry["min_top1_agreement"], entry["min_top1_margin"]
        entry.update({"masks": "selftest/masks.npy", "classes": int(host.shape[1]),
                      "min_pixel_agreement": task.min_agreement, "min_pixel_margin": float(margin[chosen].min())})
    return entry


def model_json(info: dict, task, selftest: dict, glibc_floor: str, glibcxx) -> dict:
    """model.json: what bin/run, run.py and edge verify read. A segmentation model's "task" comes
    before the model card (bin/run reads the first "task" key); classification's has none."""
    seg = {"task": task_entry(task, selftest["classes"])} if task.kind == "segmentation" else {}
    return {"made_by": "appliance package", "target": info["target"], "tvm_target": info["tvm_target"],
            **seg, "input": info["input"], "precision": info.get("precision", "fp32"),
            "glibc_floor": glibc_floor, "glibcxx_needed": glibcxx,
            "preprocessing": info.get("preprocessing"), "selftest": selftest,
            "class_names": info.get("class_names", []), "model_card": info.get("model_card"),
            "device_estimate": info.get("device_estimate")}


def task_entry(task, num_classes: int) -> dict:
    """model.json's "task" of a segmentation model: what bin/run does with its (1, K, H, W) logits."""
    return {"kind": task.kind, "ignore_label": task.ignore_label, "num_classes": num_classes,
            "output": "logits [N, K, H, W]", "postprocess": task.postprocess,
            "min_pixel_agreement": task.min_agreement}


def python_runner_wheels(wheels: list[Path], into: Path) -> list[Path]:
    """The wheels python/run.py needs, copied, with a requirements file of their sha256 for
    `pip install --no-index --require-hashes` on the device."""
    chosen = []
    for prefix in RUNNER_WHEELS:
        wheel = next((w for w in wheels if w.name.startswith(prefix)), None)
        if wheel is None:
            raise EnvironmentProblem(f"{wheels[0].parent}: no {prefix.rstrip('-')} wheel, which the Python runner needs")
        chosen.append(wheel)
        shutil.copyfile(wheel, into / wheel.name)
    lines = ["# Made by `appliance package --with-python`: the wheels in this folder, pinned by sha256.\n",
             "# pip install --no-index --no-deps --require-hashes --find-links wheels -r wheels/requirements.txt\n"]
    for wheel in chosen:
        name, version = wheel.name.split("-")[:2]
        lines.append(f"{name.replace('_', '-')}=={version} --hash=sha256:{sha256_file(wheel)}\n")
    (into / "requirements.txt").write_text("".join(lines))
    return chosen


def build_package(compiled, out, *, wheelhouse=None, with_python=False, glibc_floor=DEFAULT_GLIBC_FLOOR,
                  sample_files=None, golden_count=GOLDEN_SAMPLES, key=None) -> dict:
    compiled, out = Path(compiled), Path(out)
    glibc_floor = parse_floor(glibc_floor)
    info_path = compiled / "compile.json"
    if not info_path.is_file():
        raise DataError(f"{compiled}: not a compile directory (no compile.json; run `appliance compile` first)")
    check_outputs(compiled, "changed since it was compiled")  # compile.json among them
    info = read_result_json(info_path)
    if not isinstance(info, dict) or not str(info.get("target", "")).startswith("aarch64"):
        target = info.get("target") if isinstance(info, dict) else None
        raise DataError(f"{info_path}: compiled for {target}, but edge packages are for aarch64 "
                        "(run `appliance compile --target aarch64`)")
    if with_python and not info.get("preprocessing"):
        raise DataError(f"{info_path}: --with-python needs the model's preprocessing (python/run.py reads images), "
                        "which a model compiled without `appliance export` metadata lacks; package it without "
                        "--with-python (bin/run takes tensors)")
    wheels = locked_wheels(Path(wheelhouse) if wheelhouse else default_wheelhouse())
    # The key before the build: a bad or missing one fails now, not after minutes of work.
    key, pub, key_id, key_made = site_key(key)
    if key_made and not quiet():
        print(f"package: made the site's edge signing key {key} (key id {key_id}, mode 0600); carry {pub} to each "
              "device once (install.sh --pubkey)", file=sys.stderr, flush=True)
    # A pool to choose clear-cut golden samples from (see write_selftest).
    samples = golden_samples(compiled, sample_files, info.get("preprocessing") or {}, info["input"]["shape"],
                             golden_count * 8)
    check_input_shape(samples, info["input"]["shape"], info["input"]["name"], compiled / "model.so")

    with tempfile.TemporaryDirectory(prefix="edge-package-") as tmp:
        root = Path(tmp) / ROOT_NAME
        for sub in ("bin", "lib", "reference"):
            (root / sub).mkdir(parents=True)
        extract_runtime(wheels, Path(tmp) / "sdk", root / "lib")
        # Libraries first: a model library above the floor is refused before the (first: minutes) zig build.
        tvm_needs = check_floor({f"lib/{Path(m).name}": root / "lib" / Path(m).name for m in RUNTIME_LIBS.values()},
                                glibc_floor, origin={f"lib/{Path(m).name}": f"{wheel_of(wheels, prefix)}:{m}"
                                                     for prefix, m in RUNTIME_LIBS.items()})
        glibcxx = max((n["GLIBCXX"] for n in tvm_needs.values() if "GLIBCXX" in n), key=version_key, default=None)
        elf_needs = {**tvm_needs, **check_floor({"model.so": compiled / "model.so"}, glibc_floor, glibcxx, {"model.so"})}
        runner = ship_runner(Path(tmp) / "sdk", root / "lib", root / "bin" / "run", glibc_floor)
        elf_needs.update(check_floor({"bin/run": root / "bin" / "run"}, glibc_floor, glibcxx, {"bin/run"}))
        shutil.copyfile(compiled / "model.so", root / "model.so")
        shutil.copyfile(compiled / "model.onnx", root / "reference" / "model.onnx")
        shutil.copyfile(HERE / "edge" / "install.sh", root / "install.sh")
        shutil.copyfile(pub, root / CARRIED_PUB)  # for trust on first use only; devices trust their own copy
        (root / "install.sh").chmod(0o755)
        shipped_wheels = []
        if with_python:
            (root / "python").mkdir()
            (root / "wheels").mkdir()
            # Copied, not rewritten: the device must preprocess exactly as the host measured.

            shutil.copyfile(preprocessing.__file__, root / "python" / "preprocessing.py")
            shutil.copyfile(HERE / "edge" / "run.py", root / "python" / "run.py")
            shipped_wheels = python_runner_wheels(wheels, root / "wheels")
        task = task_of_metadata({"model_card": info.get("model_card")})
        selftest = write_selftest(root, samples, compiled / "model.onnx", info.get("precision", "fp32"), golden_count,
                                  task)
        atomic_write_text(root / "model.json", json.dumps(model_json(info, task, selftest, glibc_floor, glibcxx),
                                                          indent=2) + "\n")
        write_manifest(root, "package", [compiled / "model.so", info_path, compiled / "model.onnx", *shipped_wheels,
                                         *samples.files],
                       {"target": info["target"], "glibc_floor": glibc_floor, "elf_needs": elf_needs, "runner": runner,
                        "with_python": with_python, "wheels": [w.name for w in shipped_wheels],
                        "selftest": {k: selftest[k] for k in ("samples", "source", "max_abs_diff")}})
        # Written last and over everything else (manifest.json too): what install.sh checks on the device.
        files = sorted(p for p in root.rglob("*") if p.is_file())
        atomic_write_text(root / "SHA256SUMS", "".join(
            f"{sha256_file(p)}  {p.relative_to(root)}\n" for p in files))
        sign_sums(root, key, f"package:{out.name}\ttarget:{info['target']}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(root, arcname=ROOT_NAME)
        partial.replace(out)
        return {"path": str(out), "bytes": out.stat().st_size, "files": len(files) + 2, "key_id": key_id,
                "public_key": str(pub),
                "wheels": [w.name for w in shipped_wheels], "with_python": with_python, "glibc_floor": glibc_floor,
                "elf_needs": elf_needs, "runner": runner, "selftest_samples": selftest["samples"],
                "selftest_source": selftest["source"]}


@dataclass(frozen=True)
class PackageResult:
    out_dir: Path
    package: Path
    target: str
    bytes: int
    info: dict = field(default_factory=dict)

    @classmethod
    def load(cls, out_dir: Path) -> "PackageResult":
        record = read_result_json(Path(out_dir) / PACKAGE_RESULT_JSON)
        return cls(Path(out_dir), Path(out_dir) / record["package"], record["target"], record["bytes"],
                   record.get("info", {}))

    def figures(self) -> dict:
        return {"package": str(self.package), "bytes": self.bytes, "info": self.info}


def package_file_name(target: str) -> str:
    return f"edge-package-{target}.tar"


def package_stage(compiled, out_dir: Path | None = None, *, tar: Path | None = None, sample_files=None,
                  **options) -> PackageResult:
    """The edge package of a compiled model: `appliance package` and the pipeline's package stage.

    compiled: a compile stage's result (its out_dir, target, library, report) or a compile directory.
    The tar is `tar`, else out_dir/edge-package-<target>.tar. With out_dir the stage directory also gets
    package.json and a manifest (its lineage assembled by write_manifest); without it (`appliance
    package --out FILE`) only the tar is written. options: those of build_package (wheelhouse,
    with_python, glibc_floor, key)."""
    compile_dir = Path(getattr(compiled, "out_dir", compiled))
    if tar is None:
        tar = Path(out_dir) / package_file_name(compiled.target)
    tar = Path(tar)
    info = build_package(compile_dir, tar, sample_files=list(sample_files) if sample_files else None, **options)
    target = json.loads((compile_dir / "compile.json").read_text())["target"]  # build_package checked it
    if out_dir is None:
        return PackageResult(tar.parent, tar, target, tar.stat().st_size, info)
    out_dir = Path(out_dir)
    record = {"package": tar.name, "target": target, "bytes": tar.stat().st_size, "info": info}
    atomic_write_text(out_dir / PACKAGE_RESULT_JSON, json.dumps(record, indent=2) + "\n")
    # The package carries its own manifest inside; this one describes the stage directory.
    write_manifest(out_dir, "package", [compiled.library, compiled.report], {"target": target})
    return PackageResult.load(out_dir)
