"""`appliance package --target x86_64-openvino`: an OpenVINO build -> one signed server package tar.

The tar holds edge-package/ (the edge packages' layout, so one unpacking and signature check serves
both): model.xml and model.bin (the IR), model.json ("runtime": "openvino", input, preprocessing,
class names, the self-test's bounds), python/run.py (the runner: the openvino and numpy wheels only,
which the bundle's `openvino` profile installs on the server) with python/preprocessing.py (a
verbatim copy of the host's) and python/requirements.txt (the versions it was checked with),
selftest/ (golden validation samples and the host's onnxruntime outputs: `python/run.py --selftest`),
reference/model.onnx (what `appliance edge verify` compares with), manifest.json (lineage back to the
training data), signing-key.pub, SHA256SUMS and SHA256SUMS.minisig (the site's edge key).
"""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import tempfile
from pathlib import Path

from appliance.deploy.compiled import COMPILE_JSON
from appliance.core.errors import DataError
from appliance.core.manifest import atomic_write_text, check_outputs, sha256_file, write_manifest
from appliance.core.progress import quiet
from appliance.core.stage import read_result_json
from appliance.deploy.edge.signing import CARRIED_PUB, sign_sums, site_key
from appliance.deploy.golden import GOLDEN_SAMPLES, golden_samples, task_entry, write_selftest
from appliance.deploy.openvino_route import COMPILE_TARGET, IR_BIN, IR_XML, PACKAGE_TARGET, RUNTIME, require_openvino
from appliance.deploy.samples import check_input_shape
from appliance.tasks import task_of_metadata
from data_tools import preprocessing

HERE = Path(__file__).resolve().parent
ROOT_NAME = "edge-package"  # the unpacking, SHA256SUMS and signature checks of edge packages apply unchanged


def compiled_target(compiled: Path) -> str | None:
    """The target compile.json names, or None where there is no readable one (build_package says why)."""
    try:
        info = read_result_json(Path(compiled) / COMPILE_JSON)
    except (DataError, OSError):
        return None
    return info.get("target") if isinstance(info, dict) else None


def check_package_target(compiled: Path, package_target: str | None) -> None:
    """--target agrees with what COMPILE_DIR holds (None: whatever it holds)."""
    built = compiled_target(compiled)
    if package_target is None or built is None:
        return
    if (package_target == PACKAGE_TARGET) != (built == COMPILE_TARGET):
        want = f"`appliance compile --target {COMPILE_TARGET}`" if package_target == PACKAGE_TARGET else \
            "`appliance compile --target aarch64`"
        raise DataError(f"{Path(compiled) / COMPILE_JSON}: compiled for {built}, not for --target {package_target} "
                        f"(package a build of {want})")


def build_server_package(compiled, out, *, sample_files=None, golden_count=GOLDEN_SAMPLES, key=None,
                         **_edge_options) -> dict:
    """The server package tar at out; returns what package.json records. _edge_options: those of the
    edge package (glibc_floor, wheelhouse, with_python), which a server package has no use for."""
    ov = require_openvino(f"{compiled}: --target {PACKAGE_TARGET}")
    compiled, out = Path(compiled), Path(out)
    info_path = compiled / COMPILE_JSON
    check_outputs(compiled, "changed since it was compiled")
    info = read_result_json(info_path)
    if info.get("runtime") != RUNTIME:
        raise DataError(f"{info_path}: compiled for {info.get('target')}, not OpenVINO IR (run "
                        f"`appliance compile --target {COMPILE_TARGET}`)")
    key, pub, key_id, key_made = site_key(key)
    if key_made and not quiet():
        print(f"package: made the site's edge signing key {key} (key id {key_id}, mode 0600); carry {pub} to each "
              "server once", file=sys.stderr, flush=True)
    samples = golden_samples(compiled, sample_files, info.get("preprocessing") or {}, info["input"]["shape"],
                             golden_count * 8)
    check_input_shape(samples, info["input"]["shape"], info["input"]["name"], compiled / IR_XML)

    with tempfile.TemporaryDirectory(prefix="server-package-") as tmp:
        root = Path(tmp) / ROOT_NAME
        for sub in ("python", "reference"):
            (root / sub).mkdir(parents=True)
        for name in (IR_XML, IR_BIN):
            shutil.copyfile(compiled / name, root / name)
        shutil.copyfile(compiled / "model.onnx", root / "reference" / "model.onnx")
        shutil.copyfile(HERE / "run.py", root / "python" / "run.py")
        shutil.copyfile(preprocessing.__file__, root / "python" / "preprocessing.py")  # the host's, verbatim
        (root / "python" / "requirements.txt").write_text(
            "# Made by `appliance package --target x86_64-openvino`: what python/run.py was checked with; the\n"
            "# bundle's `openvino` profile installs these (hash-locked) on the server.\n"
            f"openvino=={ov.__version__.split('-')[0]}\nnumpy\n")
        shutil.copyfile(pub, root / CARRIED_PUB)
        task = task_of_metadata({"model_card": info.get("model_card")})
        selftest = write_selftest(root, samples, compiled / "model.onnx", info.get("precision", "fp32"), golden_count,
                                  task)
        seg = {"task": task_entry(task, selftest["classes"])} if task.kind == "segmentation" else {}
        model = {"made_by": "appliance package", "target": PACKAGE_TARGET, "runtime": RUNTIME,
                 "openvino_version": info.get("openvino_version"), **seg, "ir": {"xml": IR_XML, "bin": IR_BIN},
                 "input": info["input"], "precision": info.get("precision", "fp32"),
                 "inference_precision": info.get("inference_precision"), "preprocessing": info.get("preprocessing"),
                 "selftest": selftest, "class_names": info.get("class_names", []),
                 "model_card": info.get("model_card"), "host_figures": {k: info.get(k) for k in (
                     "device", "host_latency_ms", "hints", "onnxruntime_latency_ms")}}
        atomic_write_text(root / "model.json", json.dumps(model, indent=2) + "\n")
        write_manifest(root, "package", [compiled / IR_XML, compiled / IR_BIN, info_path, compiled / "model.onnx",
                                         *samples.files],
                       {"target": PACKAGE_TARGET, "runtime": RUNTIME,
                        "selftest": {k: selftest[k] for k in ("samples", "source", "max_abs_diff")}})
        files = sorted(p for p in root.rglob("*") if p.is_file())
        atomic_write_text(root / "SHA256SUMS", "".join(f"{sha256_file(p)}  {p.relative_to(root)}\n" for p in files))
        sign_sums(root, key, f"package:{out.name}\ttarget:{PACKAGE_TARGET}")
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(f".{out.name}.partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(root, arcname=ROOT_NAME)
        partial.replace(out)
    return {"path": str(out), "bytes": out.stat().st_size, "files": len(files) + 2, "key_id": key_id,
            "public_key": str(pub), "target": PACKAGE_TARGET, "runtime": RUNTIME, "wheels": [], "with_python": True,
            "glibc_floor": None, "selftest_samples": selftest["samples"], "selftest_source": selftest["source"]}
