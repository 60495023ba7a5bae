"""The TVM compiler: ONNX -> Relax (frontend) -> ordered passes -> build -> check -> compile.json."""
