"""A compile directory as the compile stage writes it and the package stage reads it: its file names
and its typed result, CompileResult. Shared by the compile stage (appliance/deploy/compile.py), every
compile target that writes such a directory (the TVM driver in compiler/, the GPU routes in gpu/) and
the package stage, which may not import another stage's module (docs/dev/architecture.md, rule 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.core.stage import Figures, flat_figures, read_result_json

COMPILE_JSON = "compile.json"  # every target's record: target, input, the check, builds or passes, ...
COMPILED_LIBRARY = "model.so"  # a TVM target's library
REFERENCE_MODEL = "model.onnx"  # the ONNX model the build was made from: what edge verify compares with


@dataclass(frozen=True)
class CompileResult:
    """What any compile target produced: its directory, target, the artifact a package ships (a TVM
    target's model.so, a GPU route's first build) and compile.json's content."""

    out_dir: Path
    target: str
    library: Path
    info: dict

    @classmethod
    def load(cls, out_dir: Path) -> "CompileResult":
        out_dir = Path(out_dir)
        info = read_result_json(out_dir / COMPILE_JSON)
        builds = info.get("builds") if isinstance(info, dict) else None
        # A GPU route's first build, else the library compile.json names (TVM's model.so, OpenVINO's model.xml).
        library = (Path(builds[0]["artifact"]) if builds
                   else out_dir / Path(info.get("library") or COMPILED_LIBRARY).name)
        return cls(out_dir, info["target"], library, info)

    @property
    def report(self) -> Path:
        """compile.json: what a package of this build records as its input beside the library."""
        return self.out_dir / COMPILE_JSON

    @property
    def runtime(self) -> str:
        """What the edge package runs: "tvm" (this build) or "onnxruntime" (compile.json's runtime_reason)."""
        return self.info.get("runtime", "tvm")

    @property
    def reference_model(self) -> Path:
        return self.out_dir / REFERENCE_MODEL

    def figures(self) -> Figures:
        """The target, the artifact and compile.json flat ("layers.int8", "check.top1_agreement", ...)."""
        rest = {k: v for k, v in self.info.items() if k not in ("target", "library")}
        return {"target": self.target, "library": str(self.library), **flat_figures(rest)}
