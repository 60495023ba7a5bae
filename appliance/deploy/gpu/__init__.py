"""The GPU deploy routes (onnxruntime CUDA / TensorRT): a library, no argparse, no printing."""
