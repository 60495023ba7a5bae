"""Real INT8 arithmetic for QDQ models: each quantized conv2d/matmul runs on int8 with int32 sums.

TVM's ONNX importer turns a QDQ layer into float32 arithmetic between dequantize and quantize
(simulated quantization): `conv2d(dequantize(xq, sx, zx), dequantize(Wq, sw, 0))`. Since

    sx*(xq - zx) (*) sw*Wq  =  sx*sw * (xq (*) Wq - zx * sum(Wq))

(and a zero-padded float input is an xq padded with zx), the same layer is rewritten here into
`pad(xq, zx)`, an int8 x int8 -> int32 conv2d (or matmul), the constant zero-point correction and
one float multiply by sx*sw per output channel. What follows (bias add, quantize) is unchanged, so
outputs differ from the float reference only by the float reference's own rounding. uint8
activations are shifted to int8 (xq - 128, zx - 128) so that signed dot products (sdot) apply.

A layer that does not have this shape (weights not constant, a weight zero point, per-channel
activations, an unusual layout) stays simulated and is reported by `classify_layers`.
"""

from __future__ import annotations

import numpy as np

CONV, MATMUL, DEQUANTIZE = "relax.nn.conv2d", "relax.matmul", "relax.dequantize"
QUANT_DTYPES = ("int8", "uint8")


def run(mod, build):
    """The pass: with --int8-compute int8, the quantized layers rewritten to int8 arithmetic; then
    the layers counted (build.layers): {"int8", "simulated", "fp32", "simulated_layers"}."""
    if build.options["int8_compute"] == "int8":
        mod = rewrite_int8(mod)
    build.layers = classify_layers(mod, build.onnx_model)
    return mod, {name: build.layers[name] for name in ("int8", "simulated", "fp32")}


def rewrite_int8(mod):
    """mod with every quantized conv2d/matmul of `main` it can handle computing in int8."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, wildcard

    def dq(data):
        return is_op(DEQUANTIZE)(data, is_const(), is_const())

    x, w = dq(wildcard()), dq(is_const())
    conv = is_op(CONV)(x, w)
    transposed = is_op("relax.permute_dims")(w)
    matmul = is_op(MATMUL)(x, w) | is_op(MATMUL)(x, transposed)

    def rewriter(expr, matches):
        try:
            if expr.op.name == CONV:
                return _int8_conv(expr, matches[x], matches[w])
            return _int8_matmul(expr, matches[x], matches[w], matches.get(transposed))
        except _CannotRewrite:
            return expr

    mod = mod.clone() if hasattr(mod, "clone") else mod  # the caller's module stays as it was
    mod["main"] = relax.dpl.rewrite_call(conv | matmul, rewriter, mod["main"])
    return relax.transform.DeadCodeElimination(["main"])(mod)


class _CannotRewrite(Exception):
    pass


def _const(expr) -> np.ndarray:
    import tvm

    if not isinstance(expr, tvm.ir.GenericConst):
        raise _CannotRewrite
    return expr.value.numpy()


def _dtype(expr) -> str:
    return expr.ty.dtype


def _activation(dq_call):
    """(xq as int8, zero point as int, scale as float) of a per-tensor dequantize(xq, sx, zx)."""
    from tvm import relax

    xq, scale, zero = dq_call.args
    dtype = _dtype(xq)
    scale, zero = _const(scale), _const(zero)
    if dtype not in QUANT_DTYPES or scale.size != 1 or zero.size != 1 or _dtype(dq_call) != "float32":
        raise _CannotRewrite
    zx = int(zero.reshape(()))
    if dtype == "uint8":  # the same values shifted into int8, so signed int8 dot products apply
        xq = relax.op.astype(relax.op.subtract(relax.op.astype(xq, "int16"), relax.const(128, "int16")), "int8")
        zx -= 128
    return xq, zx, float(scale.reshape(()))


def _weights(dq_call, transpose=None):
    """(int8 weights, per-element float scale broadcast to their shape) of dequantize(Wq, sw, 0)."""
    wq_expr, scale, zero = dq_call.args
    wq, scale, zero = _const(wq_expr), _const(scale).astype(np.float64), _const(zero)
    if wq.dtype != np.int8 or np.any(zero != 0):
        raise _CannotRewrite
    axis = int(dq_call.attrs.axis)
    if scale.size == 1:
        full = np.full(wq.shape, float(scale.reshape(())))
    else:
        shape = [1] * wq.ndim
        shape[axis % wq.ndim] = -1
        full = np.broadcast_to(scale.reshape(shape), wq.shape)
    if transpose is not None:
        wq, full = wq.transpose(transpose), full.transpose(transpose)
    return wq, full


def _int8_conv(call, x_dq, w_dq):
    from tvm import relax

    attrs = call.attrs
    if (attrs.data_layout != "NCHW" or attrs.kernel_layout != "OIHW" or attrs.out_layout != "NCHW"
            or _dtype(call) != "float32"):
        raise _CannotRewrite
    xq, zx, sx = _activation(x_dq)
    wq, sw = _weights(w_dq)
    per_channel = sw.reshape(sw.shape[0], -1)
    if not np.all(per_channel == per_channel[:, :1]):  # a scale that varies inside one output channel
        raise _CannotRewrite
    top, left, bottom, right = (int(p) for p in attrs.padding)
    if top or left or bottom or right:  # float zero padding is xq == zx
        xq = relax.op.nn.pad(xq, [0, 0, 0, 0, top, bottom, left, right], pad_value=float(zx))
    acc = relax.op.nn.conv2d(xq, relax.const(wq), strides=attrs.strides, padding=[0, 0, 0, 0],
                             dilation=attrs.dilation, groups=int(attrs.groups), out_dtype="int32")
    shape = (1, -1, 1, 1)
    if zx:
        correction = zx * wq.astype(np.int64).reshape(wq.shape[0], -1).sum(1)
        acc = relax.op.subtract(acc, relax.const(correction.astype(np.int32).reshape(shape)))
    scale = (sx * per_channel[:, 0]).astype(np.float32).reshape(shape)
    return relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(scale))


def _int8_matmul(call, x_dq, w_dq, transposed):
    from tvm import relax

    if _dtype(call) != "float32":
        raise _CannotRewrite
    xq, zx, sx = _activation(x_dq)
    if transposed is not None:
        axes = transposed.attrs.axes
        wq, sw = _weights(w_dq, [1, 0] if axes is None else [int(a) for a in axes])
    else:
        wq, sw = _weights(w_dq)
    if wq.ndim != 2 or not np.all(sw == sw[:1, :]):  # one scale per output column
        raise _CannotRewrite
    acc = relax.op.matmul(xq, relax.const(np.ascontiguousarray(wq)), out_dtype="int32")
    if zx:
        correction = zx * wq.astype(np.int64).sum(0)
        acc = relax.op.subtract(acc, relax.const(correction.astype(np.int32)))
    return relax.op.multiply(relax.op.astype(acc, "float32"), relax.const((sx * sw[0]).astype(np.float32)))


def classify_layers(mod, onnx_model) -> dict:
    """Counts of int8, simulated (float between dequantize ops) and fp32 conv2d/matmul layers of
    `main`, with the ONNX node names of the simulated ones (in graph order)."""
    import tvm
    from tvm import relax

    kinds = []
    for block in mod["main"].body.blocks:
        values = {b.var: b.value for b in block.bindings}
        for binding in block.bindings:
            value = binding.value
            if (not isinstance(value, relax.Call) or not isinstance(value.op, tvm.ir.Op)
                    or value.op.name not in (CONV, MATMUL)):
                continue
            data = value.args[0]
            if _dtype(data) in QUANT_DTYPES:
                kinds.append("int8")
                continue
            source = values.get(data, data)
            quantized = isinstance(source, relax.Call) and getattr(source.op, "name", "") == DEQUANTIZE
            kinds.append("simulated" if quantized else "fp32")
    names = [n.name or f"{n.op_type} #{i}" for i, n in enumerate(
        n for n in onnx_model.graph.node if n.op_type in ("Conv", "Gemm", "MatMul"))]
    if len(names) != len(kinds):  # the importer split or merged a layer: name them by position
        names = [f"layer {i}" for i in range(len(kinds))]
    return {"int8": kinds.count("int8"), "simulated": kinds.count("simulated"), "fp32": kinds.count("fp32"),
            "simulated_layers": [name for name, kind in zip(names, kinds) if kind == "simulated"]}


def output_scale(onnx_model) -> float | None:
    """The quantization step of the model's first output when a per-tensor DequantizeLinear makes it."""
    from onnx import numpy_helper

    name = onnx_model.graph.output[0].name
    producer = next((n for n in onnx_model.graph.node if name in n.output), None)
    if producer is None or producer.op_type != "DequantizeLinear":
        return None
    scale = next((t for t in onnx_model.graph.initializer if t.name == producer.input[1]), None)
    if scale is None:
        return None
    value = numpy_helper.to_array(scale)
    return float(value.reshape(())) if value.size == 1 else None
