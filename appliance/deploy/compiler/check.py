"""The host build checked: its outputs against onnxruntime's on the same tensors, and its latency here.

Only the x86_64 build runs on this machine; an aarch64 build is checked on the device (or under
qemu) by `appliance edge verify`.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from appliance.deploy.compiler.runtime import use_physical_cores
from appliance.deploy.onnx_model import ort_session, run_ort
from appliance.deploy.samples import check_input_shape, load_samples
from appliance.tasks import task_of_metadata

# Default check of a QDQ model: output quantization steps allowed. The float32 reference's rounding
# moves values across quantization boundaries and deep nets carry that on (measured up to 7 steps on
# an untrained MobileNetV2, 98 % of logits within 2); real errors (a wrong scale) are tens of steps.
QDQ_UNITS = 8


def check_against_ort(library, model_path, shape, sample_files, meta, tolerance, input_name="input",
                      output_step=None) -> dict:
    """Run the host library through the Relax VM and onnxruntime on the same tensors.

    For a QDQ model (output_step: its output quantization step) QDQ_UNITS steps are allowed too:
    a float rounding difference in one layer moves a value by one step, and later layers carry it.
    A segmentation model's (N, K, H, W) logits are compared per pixel too: its class maps must agree
    on the task's min_agreement of the pixels (`pixel_agreement`)."""
    import tvm
    from tvm import relax

    use_physical_cores()

    if sample_files:
        samples = load_samples(sample_files, meta.get("preprocessing", {}), limit=32)
        check_input_shape(samples, shape, input_name, model_path)
        x = samples.x
        if len(x) % shape[0]:  # a fixed batch: whole batches only, the samples repeated to fill the last
            x = np.resize(x, (-(-len(x) // shape[0]) * shape[0], *x.shape[1:]))
    else:
        x = np.random.default_rng(0).standard_normal((-(-8 // shape[0]) * shape[0], *shape[1:])).astype(np.float32)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    got = np.concatenate([vm["main"](tvm.runtime.tensor(x[i:i + shape[0]])).numpy() for i in range(0, len(x), shape[0])])
    expected = run_ort(ort_session(model_path, optimize=False), x)
    diff = float(np.abs(got.astype(np.float64) - expected).max())
    allowed = tolerance * max(1.0, float(np.abs(expected).max()))
    if output_step:
        allowed = max(allowed, QDQ_UNITS * output_step * (1 + 1e-5))
    result = {"samples": int(len(x)), "max_abs_diff": diff, "allowed": allowed,
              "max_quantized_units": diff / output_step if output_step else None,
              "top1_agreement": float((got.argmax(1) == expected.argmax(1)).mean()), "passed": diff <= allowed}
    task = task_of_metadata(meta)
    if task.kind == "segmentation":
        agreement = task.agreement(got, expected)
        result.update({"task": task.kind, "pixel_agreement": agreement, "min_pixel_agreement": task.min_agreement,
                       "passed": result["passed"] and agreement >= task.min_agreement})
    elif task.kind == "detection":  # boxes decoded from both outputs: same class, IoU >= 0.9
        agreement = task.agreement(got, expected)
        result.update({"task": task.kind, "box_agreement": agreement, "min_box_agreement": task.min_agreement,
                       "passed": result["passed"] and agreement >= task.min_agreement})
    return result


def host_latency_ms(library, shape, budget_s: float = 3.0) -> float:
    """Median ms of one call of the host library on this CPU (1 warm-up call, at most 10 timed
    calls or budget_s), on its physical cores (runtime.py); a figure for comparing builds on
    the same machine, not an edge latency."""
    import tvm
    from tvm import relax

    use_physical_cores()
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    x = tvm.runtime.tensor(np.zeros(shape, np.float32))
    vm["main"](x)
    times, start = [], time.perf_counter()
    while len(times) < 10 and (len(times) < 3 or time.perf_counter() - start < budget_s):
        t = time.perf_counter()
        vm["main"](x)
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)
