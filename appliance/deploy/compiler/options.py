"""The choices `compile_model` takes (the CLI offers them): what each layer kind may run on."""

INT8_COMPUTE = ("int8", "simulated")
INT8_KERNELS = ("auto", "generic")  # auto: the CPU's dot-product kernels where this build has them (kernels/registry.py)
FP32_KERNELS = ("auto", "generic")  # auto: register-tiled float32 convolutions where the CPU has a vector unit
# What the edge package runs: our TVM build, onnxruntime on the same ONNX model, or the faster of the two
# as compile estimates them (compiler/runtime_choice.py).
RUNTIMES = ("auto", "tvm", "onnxruntime")
