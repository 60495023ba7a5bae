"""The golden samples a package carries: real validation samples chosen for a clear top-1, and the
host's onnxruntime outputs for them (selftest/), shared by the edge package (appliance.deploy.package)
and the OpenVINO server package (appliance.deploy.openvino_route.server_package)."""

from __future__ import annotations

from pathlib import Path

from appliance.deploy.compiled import COMPILE_JSON
from appliance.core.manifest import read_manifest, sha256_file
from appliance.core.errors import DataError
from appliance.deploy.onnx_model import default_tolerance, ort_session, run_ort
from appliance.deploy.samples import load_samples, synthetic_samples
from appliance.deploy.tolerance import qdq_allowance

GOLDEN_SAMPLES = 8


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
    return synthetic_samples(preprocessing, shape[1], count, shape, compiled / COMPILE_JSON)

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

def task_entry(task, num_classes: int) -> dict:
    """model.json's "task" of a segmentation model: what bin/run does with its (1, K, H, W) logits."""
    return {"kind": task.kind, "ignore_label": task.ignore_label, "num_classes": num_classes,
            "output": "logits [N, K, H, W]", "postprocess": task.postprocess,
            "min_pixel_agreement": task.min_agreement}
