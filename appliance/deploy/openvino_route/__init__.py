"""The OpenVINO route for x86 inference servers (Intel or AMD): `appliance compile --target openvino`
(ONNX -> OpenVINO IR, checked against onnxruntime, timed under OpenVINO's LATENCY and THROUGHPUT
hints: build.py), `appliance package --target x86_64-openvino` (a signed server package whose
Python runner runs the IR on the openvino wheel: server_package.py, run.py) and its check on the host
by `appliance edge verify` (server_verify.py).

This package's top stays light (the CLI and the pipeline config read the names below while they
register verbs and check targets): no openvino, numpy or onnx here.
"""

from __future__ import annotations

from appliance.core.errors import EnvironmentProblem

COMPILE_TARGET = "openvino"  # `appliance compile --target openvino`, `[compile] targets`
PACKAGE_TARGET = "x86_64-openvino"  # `appliance package --target x86_64-openvino`, `[package] target`
RUNTIME = "openvino"  # compile.json's and model.json's "runtime" of this route
IR_XML, IR_BIN = "model.xml", "model.bin"
PROFILE = "openvino"  # the bundle profile that carries the wheels (manifests/openvino.in)


def compile_target_of(package_target: str) -> str:
    """The compile target whose build a package target packs (aarch64 packs aarch64's)."""
    return COMPILE_TARGET if package_target == PACKAGE_TARGET else package_target


def require_openvino(what: str):
    """The openvino module, or one line saying how to get it (the wheel is in the `openvino` profile)."""
    try:
        import openvino
    except ImportError:
        raise EnvironmentProblem(f"{what}: the openvino wheel is not installed in this environment "
                                 f"(install the bundle's `{PROFILE}` profile, or `pip install openvino`)") from None
    return openvino
