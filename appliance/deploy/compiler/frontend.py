"""The frontend: an ONNX model into a Relax module at a fixed input shape (`import_relax`).

## Static shapes for TVM's ONNX importer: fix the batch axis and fold shape arithmetic to constants

PyTorch exports `x.view(n, groups, c // groups, h, w)` (ShuffleNet's channel shuffle, for one) as
Shape -> Gather -> Div -> Unsqueeze -> Concat -> Reshape. TVM 0.27 imports that chain as Relax
shape expressions that it cannot compile (`shape_of expects a tensor input` with a dynamic batch,
`CodeGenVM cannot emit R.concat` with a static one). With the input shape fixed, every Shape has a
known value, and the small integer computations after it can be evaluated here, like
onnx-simplifier does, so that TVM sees a Reshape with a constant shape.

Only nodes whose inputs are all small constants are evaluated; quantize/dequantize nodes are left
alone so that a QDQ model keeps the form the int8 rewrite reads.
"""

from __future__ import annotations

from appliance.core.errors import DataError

MAX_FOLDED_ELEMENTS = 64  # shape arithmetic is a few integers; weights and activations are never folded
KEEP = {"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear"}


def find_unsupported(model) -> list[str]:
    """'OpType (node NAME)' for each node TVM's ONNX importer has no converter for."""
    from tvm.relax.frontend.onnx.onnx_frontend import _get_convert_map

    known = _get_convert_map()
    standard = ("", "ai.onnx")
    return [f"{n.op_type} (node {n.name or '?'})" for n in model.graph.node
            if n.domain not in standard or n.op_type not in known]


def import_relax(model, path, shape: list):
    """The Relax IRModule for the ONNX model at a fixed input shape; one line when TVM cannot."""
    from tvm import relax
    from tvm.relax.frontend.onnx import from_onnx

    unsupported = find_unsupported(model)
    if unsupported:
        raise DataError(f"{path}: TVM cannot import operator {', '.join(unsupported[:3])}"
                        f"{' and more' if len(unsupported) > 3 else ''}; compile the FP32 model or the "
                        "FP16/QDQ one from `appliance quantize` instead")
    name = next(i.name for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer})
    model = fold_shapes(model, name, shape)
    try:
        mod = from_onnx(model, shape_dict={name: shape}, keep_params_in_input=False)
    except Exception as err:
        raise DataError(f"{path}: TVM could not import the model ({type(err).__name__}: "
                        f"{str(err).strip().splitlines()[0] if str(err).strip() else ''}); "
                        "try the FP32 or FP16 model") from None
    return relax.transform.DecomposeOpsForInference()(mod)


def fold_shapes(model, input_name: str, shape: list):
    """A copy of model with input_name fixed to shape and its shape computations constant."""
    import onnx
    from onnx import numpy_helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    graph = model.graph
    for value in graph.input:
        if value.name == input_name:
            for dim, size in zip(value.type.tensor_type.shape.dim, shape):
                dim.Clear()
                dim.dim_value = int(size)
    if not any(n.op_type == "Shape" for n in graph.node):
        return model
    while _fold_once(model, onnx, numpy_helper):
        pass
    return model


def _fold_once(model, onnx, numpy_helper) -> bool:
    """One pass over the graph; True when something was folded."""
    import numpy as np

    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {}
    for value in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if value.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes[value.name] = [d.dim_value for d in dims]
    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 17)
    folded, keep = [], []
    for node in graph.node:
        value = _evaluate(node, consts, shapes, opset, onnx, numpy_helper, np)
        if value is None:
            keep.append(node)
            continue
        for name, array in zip(node.output, value):
            consts[name] = array
            folded.append(numpy_helper.from_array(np.asarray(array), name))
    if not folded:
        return False
    del graph.node[:]
    graph.node.extend(keep)
    graph.initializer.extend(folded)
    used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
    kept = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return True


def _evaluate(node, consts, shapes, opset, onnx, numpy_helper, np):
    """The output arrays of node when it can be computed now, else None."""
    if node.op_type in KEEP or node.domain not in ("", "ai.onnx"):
        return None
    if node.op_type == "Shape":
        shape = shapes.get(node.input[0])
        if shape is None:
            return None
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), attrs.get("end", len(shape))
        return [np.array(shape[start:end], np.int64)]
    if node.op_type == "Constant":
        tensor = next((a.t for a in node.attribute if a.name == "value"), None)
        array = None if tensor is None else numpy_helper.to_array(tensor)
        return [array] if array is not None and array.size <= MAX_FOLDED_ELEMENTS else None
    if not node.input:
        return None
    inputs = [consts.get(name) if name else None for name in node.input]
    if any(name and array is None for name, array in zip(node.input, inputs)):
        return None
    if any(a is not None and a.size > MAX_FOLDED_ELEMENTS for a in inputs):
        return None
    from onnx.reference import ReferenceEvaluator

    try:
        return ReferenceEvaluator(_one_node_model(node, inputs, opset)).run(
            None, {name: a for name, a in zip(node.input, inputs) if name})
    except Exception:  # an op the reference evaluator lacks: leave it to TVM
        return None


def _one_node_model(node, inputs, opset):
    from onnx import helper

    values = [helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
              for name, a in zip(node.input, inputs) if name]
    outputs = [helper.make_empty_tensor_value_info(name) for name in node.output]
    graph = helper.make_graph([node], "fold", values, outputs)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
