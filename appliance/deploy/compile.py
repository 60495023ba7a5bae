"""`appliance compile` as a stage: the TVM build (appliance.deploy.compiler), or the OpenVINO IR
(appliance.deploy.openvino_route), of a model that passed its quantize gate, with its typed result
(model.so or model.xml, compile.json)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.core.stage import read_result_json
from appliance.deploy.compiler.driver import compile_model
from appliance.deploy.openvino_route import COMPILE_TARGET as OPENVINO
from appliance.deploy.openvino_route.build import compile_openvino
from appliance.deploy.tolerance import refuse_failed_gate

COMPILED_LIBRARY = "model.so"
COMPILE_JSON = "compile.json"


@dataclass(frozen=True)
class CompileResult:
    out_dir: Path
    target: str
    library: Path
    info: dict

    @classmethod
    def load(cls, out_dir: Path) -> "CompileResult":
        out_dir = Path(out_dir)
        info = read_result_json(out_dir / COMPILE_JSON)
        # The TVM build's model.so, or the OpenVINO route's model.xml: compile.json names it.
        return cls(out_dir, info["target"], out_dir / Path(info.get("library") or COMPILED_LIBRARY).name, info)

    @property
    def report(self) -> Path:
        """compile.json: what a package of this build records as its input beside the library."""
        return self.out_dir / COMPILE_JSON

    def figures(self) -> dict:
        return {"target": self.target, "library": str(self.library), "report": self.info}


def compile_stage(model: Path, target: str, out_dir: Path, *, sample_files, allow_failed_gate: bool = False,
                  **options) -> CompileResult:
    """Compile model with TVM for target (options: those of compiler.driver.compile_model), or to OpenVINO IR
    for target "openvino" (openvino_route.build.compile_openvino); refuses a quantized model that failed its
    accuracy gate unless allow_failed_gate."""
    if not allow_failed_gate:
        refuse_failed_gate(model)
    if target == OPENVINO:
        compile_openvino(model, out_dir, sample_files=list(sample_files) if sample_files else None, **options)
        return CompileResult.load(out_dir)
    compile_model(model, target, out_dir, sample_files=list(sample_files) if sample_files else None, **options)
    return CompileResult.load(out_dir)
