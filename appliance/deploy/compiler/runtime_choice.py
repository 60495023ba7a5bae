"""Never slower than the runtime beside it: our build against onnxruntime on the same ONNX model, and the
runtime the edge package uses.

aarch64 targets: both estimated on the device's cores by the cycle model (edge/cycles.py; onnxruntime's
aarch64 wheel on the same model under the same qemu, one thread, all graph optimisations); the
onnxruntime figure depends only on the model, so it is kept per model (sha256), shape and guest wheels in
~/.cache/appliance/arm-cycles/onnxruntime/ and costs minutes once, nothing after. x86_64: measured here,
ours and onnxruntime's session alternated round by round, the median of the per-round ratios.

`auto` picks onnxruntime when our build is slower: on one core (x86_64), or on the geometric mean of the
per-core ratios (Cortex-A76 and Cortex-A55); a build that wins on one core and loses on the other says so.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import time
from pathlib import Path

import numpy as np

from appliance.core.manifest import atomic_write_text
from appliance.deploy.compiler.runtime import use_physical_cores
from appliance.deploy.edge.cycles import CLOCKS_HZ, METHOD, default_cache, estimate_build
from appliance.deploy.onnx_model import ort_session

HOST_ROUNDS = 7  # alternated rounds on the host: ratios settle within a few percent on a loaded 2-core box


def onnxruntime_device_estimate(model_path: Path, shape) -> dict:
    """onnxruntime's device_estimate of model_path (edge/cycles.py figures), cached per model and shape."""
    key = hashlib.sha256(Path(model_path).read_bytes() + json.dumps([list(shape), METHOD]).encode()).hexdigest()[:20]
    kept = default_cache() / "onnxruntime" / f"{key}.json"
    if kept.is_file():
        try:
            return {**json.loads(kept.read_text()), "cached": True}
        except ValueError:
            pass  # a torn file: estimated again
    figures = estimate_build(model_path, shape, runtime="ort")
    if figures.get("estimated"):
        kept.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(kept, json.dumps(figures) + "\n")
    return figures


def host_comparison(library: Path, model_path: Path, shape, rounds: int = HOST_ROUNDS) -> dict:
    """Our x86_64 library against onnxruntime (all optimisations) on this CPU: per round the median of 3
    calls of each after a warm-up call, alternated; the median of the per-round ratios."""
    import tvm
    from tvm import relax

    use_physical_cores()
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    vm = relax.VirtualMachine(tvm.runtime.load_module(str(library)), tvm.cpu())
    xt = tvm.runtime.tensor(x)
    session = ort_session(model_path, spinning=False)  # no spinning threads left to slow our next call
    name = session.get_inputs()[0].name
    calls = {"tvm": lambda: vm["main"](xt), "onnxruntime": lambda: session.run(None, {name: x})}
    times = {k: [] for k in calls}
    for _ in range(rounds):
        for k, call in calls.items():
            call()
            block = []
            for _ in range(3):
                t = time.perf_counter()
                call()
                block.append((time.perf_counter() - t) * 1000)
            times[k].append(statistics.median(block))
    ratio = statistics.median(a / b for a, b in zip(times["tvm"], times["onnxruntime"]))
    return {"method": f"measured on this host, {rounds} alternated rounds (median of 3 calls each), median of "
                      "the per-round ratios", "tvm_ms": round(statistics.median(times["tvm"]), 3),
            "onnxruntime_ms": round(statistics.median(times["onnxruntime"]), 3), "ratios": {"host": round(ratio, 3)}}


def device_comparison(ours: dict, peer: dict) -> dict:
    """Per core: our estimated cycles over onnxruntime's (both edge/cycles.py figures)."""
    if not ours.get("estimated"):
        return {"compared": False, "reason": f"our build: {ours.get('reason', 'not estimated')}"}
    if not peer.get("estimated"):
        return {"compared": False, "reason": f"onnxruntime: {peer.get('reason', 'not estimated')}"}
    return {"method": METHOD, "onnxruntime": {cpu: peer[cpu] for cpu in CLOCKS_HZ},
            "cached": bool(peer.get("cached")),
            "ratios": {cpu: round(ours[cpu]["cycles"] / peer[cpu]["cycles"], 3) for cpu in CLOCKS_HZ}}


def choose_runtime(requested: str, comparison: dict) -> tuple[str, str]:
    """(the runtime the package uses, one line saying why)."""
    ratios = comparison.get("ratios")
    if not ratios:
        said = f"not compared with onnxruntime ({comparison.get('reason', 'no comparison')})"
        if requested != "auto":
            return requested, f"{said}; --runtime {requested} asked for"
        return "tvm", said
    wins = [core for core, r in ratios.items() if r <= 1.0]
    loses = [core for core, r in ratios.items() if r > 1.0]
    figures = ", ".join(f"{r:.2f}x on {core}" for core, r in ratios.items())
    mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    verdict = ("faster than onnxruntime" if not loses else "slower than onnxruntime" if not wins else
               f"faster on {', '.join(wins)} but slower on {', '.join(loses)} (geometric mean {mean:.2f}x)")
    line = f"our TVM build takes {figures} of onnxruntime's time on the same model: {verdict}"
    if requested != "auto":
        return requested, f"{line}; --runtime {requested} asked for"
    chosen = "tvm" if mean <= 1.0 else "onnxruntime"
    return chosen, f"{line}; auto uses {chosen}"
