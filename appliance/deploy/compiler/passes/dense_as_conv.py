"""Classifier layers on the convolution kernels: a matmul with constant weights is a 1x1 convolution.

TVM's default CPU lowering of a matmul is the naive loop nest: MobileNetV2's 1280 x 1000 classifier
took 3.2 ms of an 18 ms float32 build and 1.5 ms of an 11 ms int8 one (measured kernel by kernel,
untuned, 2-core Xeon). The register-tiled float32 kernels (kernels/simd_conv.py) and the VNNI int8 kernels
(kernels/x86_vnni.py) compute the same products as a 1x1 convolution over a 1x1 image, with the rows of
the matmul as the batch:

    matmul(x [M, K], W [K, N])  ->  reshape(conv2d(reshape(x, [M, K, 1, 1]), W^T [N, K, 1, 1]), [M, N])

so the classifier is rewritten that way before those kernels are chosen, and only for the kernels
this build's CPU gets (the kernel dispatch pass runs it); elsewhere it stays TVM's matmul.
"""

from __future__ import annotations

import numpy as np

from appliance.deploy.compiler.kernels.common import static_shape
from appliance.deploy.compiler.passes.rewrite import rewrite_calls

MATMUL, PERMUTE = "relax.matmul", "relax.permute_dims"


def matmuls_as_convs(mod, dtypes: set[str]):
    """mod with every 2-D matmul whose data dtype is in `dtypes` and whose weights are a constant
    (or a transposed constant, as ONNX Gemm imports) written as a 1x1 conv2d; returns (mod, how many)."""
    from tvm import relax

    mod, count = rewrite_calls(mod, lambda builder, call, index: _as_conv(builder, call, dtypes))
    if count:  # the transposes of the weights that fed the matmuls: unused now
        mod = relax.transform.DeadCodeElimination()(mod)
    return mod, count


def _as_conv(builder, call, dtypes):
    import tvm
    from tvm import relax

    if not isinstance(call.op, tvm.ir.Op) or call.op.name != MATMUL:
        return None
    data, weight = call.args
    weights = _constant_weights(builder, weight)
    shape = static_shape(data)
    dtype = str(getattr(data.ty, "dtype", None))
    if weights is None or shape is None or len(shape) != 2 or weights.ndim != 2 or dtype not in dtypes \
            or weights.shape[0] != shape[1] or str(weights.dtype) != dtype:
        return None
    out_dtype = str(call.attrs.out_dtype)
    if out_dtype in ("", "None", "void"):
        out_dtype = dtype
    m, k = shape
    n = weights.shape[1]
    rows = builder.emit(relax.op.reshape(data, (m, k, 1, 1)))
    conv = builder.emit(relax.op.nn.conv2d(rows, relax.const(np.ascontiguousarray(weights.T).reshape(n, k, 1, 1)),
                                           out_dtype=out_dtype))
    return relax.op.reshape(conv, (m, n))


def _constant_weights(builder, weight) -> np.ndarray | None:
    """The [K, N] weights of a matmul: a constant, or the binding of a permute_dims of one."""
    import tvm
    from tvm import relax

    if isinstance(weight, relax.Var):
        weight = builder.lookup_binding(weight)
    if isinstance(weight, tvm.ir.GenericConst):
        return weight.value.numpy()
    if (isinstance(weight, relax.Call) and isinstance(weight.op, tvm.ir.Op) and weight.op.name == PERMUTE
            and isinstance(weight.args[0], tvm.ir.GenericConst)):
        axes = weight.attrs.axes
        value = weight.args[0].value.numpy()
        if value.ndim == 2 and (axes is None or [int(a) for a in axes] == [1, 0]):
            return value.T
    return None
