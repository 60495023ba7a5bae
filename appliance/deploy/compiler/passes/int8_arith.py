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

from appliance.deploy.compiler.passes.int8_rewrites import DEQUANTIZE, QUANT_DTYPES, _dtype, fold_requantize, pool_int8

CONV, MATMUL = "relax.nn.conv2d", "relax.matmul"


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
    mod["main"] = pool_int8(fold_requantize(relax.dpl.rewrite_call(conv | matmul, rewriter, mod["main"])))
    return relax.transform.DeadCodeElimination(["main"])(mod)


class _CannotRewrite(Exception):
    pass


def _const(expr) -> np.ndarray:
    import tvm

    if not isinstance(expr, tvm.ir.GenericConst):
        raise _CannotRewrite
    return expr.value.numpy()


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


# Ops whose output error is at most their (first) input's: they select, move, average or squash.
_NON_EXPANSIVE = {"Relu", "Flatten", "Reshape", "Identity", "Dropout", "Squeeze", "Unsqueeze", "Transpose",
                  "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool", "Resize", "Clip", "LeakyRelu",
                  "ReduceMean", "ReduceMax", "Tanh", "Softmax", "Sigmoid", "Cast", "Slice", "Gather", "Split",
                  "Pad", "DepthToSpace", "SpaceToDepth", "Upsample"}


def output_scale(onnx_model) -> float | None:
    """The error unit of the model's first output when int8 arithmetic reaches it: None for a model
    with no QDQ upstream of the output (the FP32 tolerance applies).

    Each dequantized activation may differ from onnxruntime's by a few of its quantization steps
    (float rounding before a quantize). A DequantizeLinear producing the output gives its step (per
    tensor; the largest of per-channel scales); float layers after the last quantized one (what
    `--fallback` keeps in float) carry that error on, scaled by their gain: a Gemm, MatMul or Conv with
    constant weights by the largest absolute row sum (the infinity norm, a bound on how far an error
    of one unit per element moves an output), BatchNormalization and Mul/Div by a constant by the
    largest factor; a sum of two tensors adds their errors; ops that select, average or squash
    (_NON_EXPANSIVE) pass it on. An op outside these gives None: no bound is claimed."""
    from onnx import numpy_helper

    graph = onnx_model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
    err: dict[str, float | None] = {}
    for node in graph.node:
        value = _node_error(node, consts, err)
        if node.op_type == "DequantizeLinear" and node.input[0] in consts and value is not None:
            q, scale = consts[node.input[0]], consts.get(node.input[1])
            zero = consts.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
            if scale is not None:  # a dequantized constant (weights): exact on both sides
                axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
                shape = [1] * q.ndim
                if scale.size > 1:
                    shape[axis] = -1
                z = 0 if zero is None else zero.astype(np.float64).reshape(shape)
                consts[node.output[0]] = (q.astype(np.float64) - z) * scale.astype(np.float64).reshape(shape)
                value = 0.0
        for out in node.output:
            err[out] = value
    step = err.get(graph.output[0].name, 0.0) if graph.output else None
    return float(step) if step else None


def _node_error(node, consts, err) -> float | None:
    """The error bound (in output units) of node's output given its inputs' (see output_scale)."""
    def of(name):
        return 0.0 if not name or name in consts or name not in err else err[name]

    op, ins = node.op_type, list(node.input)
    if op == "DequantizeLinear":
        if ins[0] in consts:
            return 0.0
        scale = consts.get(ins[1])
        return None if scale is None else float(np.abs(scale).max())
    if op == "QuantizeLinear":
        return of(ins[0])  # what its DequantizeLinear makes of it is counted there, in its own steps
    if op == "Resize" and any(a.name == "mode" and a.s == b"cubic" for a in node.attribute):
        e = of(ins[0])  # cubic weights sum to 1 in absolute value 1.25 per axis at most (a = -0.75)
        return None if e is None else e * 1.5625
    if op in _NON_EXPANSIVE:
        return of(ins[0])
    if op in ("Add", "Sub", "Concat", "Sum", "Max", "Min"):
        errors = [of(n) for n in ins]
        if any(e is None for e in errors):
            return None
        return max(errors) if op in ("Concat", "Max", "Min") else sum(errors)
    if op in ("Mul", "Div") and len(ins) == 2 and (ins[0] in consts) != (ins[1] in consts):
        data, c = (ins[1], consts[ins[0]]) if ins[0] in consts else (ins[0], consts[ins[1]])
        e = of(data)
        if e is None or c.size == 0 or (op == "Div" and not np.abs(c).min()):
            return None
        return e * float(np.abs(c).max() if op == "Mul" else 1 / np.abs(c).min())
    if op == "BatchNormalization" and all(n in consts for n in ins[1:]):
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        gain = np.abs(consts[ins[1]]) / np.sqrt(consts[ins[4]].astype(np.float64) + eps)
        e = of(ins[0])
        return None if e is None else e * float(gain.max())
    return _linear_error(node, consts, of)


def _linear_error(node, consts, of) -> float | None:
    op, ins = node.op_type, list(node.input)
    attrs = {a.name: a for a in node.attribute}
    if op == "Conv" and len(ins) > 1 and ins[1] in consts:
        w = consts[ins[1]]
        e = of(ins[0])
        return None if e is None else e * float(np.abs(w).reshape(w.shape[0], -1).sum(1).max())
    if op == "Gemm" and len(ins) > 1:
        data, weight, trans = ins[0], ins[1], "transB" in attrs and attrs["transB"].i
        if ins[0] in consts and ins[1] not in consts:
            data, weight, trans = ins[1], ins[0], not ("transA" in attrs and attrs["transA"].i)
        elif weight not in consts:
            return None
        w = np.abs(consts[weight])
        norm = (w.sum(1) if trans else w.sum(0)).max() * abs(attrs["alpha"].f if "alpha" in attrs else 1.0)
        e = of(data)
        return None if e is None else e * float(norm)
    if op == "MatMul" and len(ins) == 2 and (ins[0] in consts) != (ins[1] in consts):
        if ins[1] in consts:
            w, data = np.abs(consts[ins[1]]), ins[0]
            norm = w.sum(-2).max()  # x @ W: an output sums a column of W
        else:
            w, data = np.abs(consts[ins[0]]), ins[1]
            norm = w.sum(-1).max()  # W @ x: an output sums a row of W
        e = of(data)
        return None if e is None else e * float(norm)
    return None
