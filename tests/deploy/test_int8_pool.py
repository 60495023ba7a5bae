"""Max pooling of a QDQ model on the int8 values (passes/int8_rewrites.pool_int8): the same outputs, bit for
bit, as pooling the dequantized floats and quantizing again, padding included."""

import numpy as np
import pytest


def qdq_pool_module(scale, zero, dtype, requant=None):
    """int8/uint8 input -> dequantize -> 3x3/2 max pool with padding 1 -> quantize (its own scale
    and zero point, or `requant`'s) -> float32, as TVM's ONNX importer writes a QDQ MaxPool."""
    from tvm import relax

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 4, 9, 9), dtype))
    s_out, z_out = requant or (scale, zero)
    with builder.function("main", [x]):
        with builder.dataflow():
            deq = builder.emit(relax.op.dequantize(x, relax.const(np.float32(scale)), relax.const(np.array(zero, dtype)),
                                                   axis=1, out_dtype="float32"))
            pooled = builder.emit(relax.op.nn.max_pool2d(deq, pool_size=(3, 3), strides=(2, 2), padding=(1, 1, 1, 1)))
            q = builder.emit(relax.op.quantize(pooled, relax.const(np.float32(s_out)),
                                               relax.const(np.array(z_out, dtype)), axis=1, out_dtype=dtype))
            out = builder.emit_output(relax.op.astype(q, "float32"))
        builder.emit_func_output(out)
    return builder.get()


def run(mod, x):
    import tvm
    from tvm import relax

    from appliance.deploy.compiler.passes.legalize_fuse import legalize_and_fuse

    vm = relax.VirtualMachine(tvm.compile(legalize_and_fuse(mod), target="llvm"), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def pools(mod, dtype: str) -> list:
    import tvm
    from tvm import relax

    found = []

    def visit(expr):
        if isinstance(expr, relax.Call) and getattr(expr.op, "name", None) == "relax.nn.max_pool2d":
            found.append(str(expr.args[0].ty.dtype))

    relax.analysis.post_order_visit(mod["main"], visit)
    return found


@pytest.mark.parametrize("dtype, zero, requant", [("int8", -128, None), ("int8", 5, None), ("uint8", 0, None),
                                                   ("uint8", 131, None), ("int8", 3, (0.07, -2))])
def test_max_pool_runs_on_int8_with_the_same_outputs(dtype, zero, requant):
    from appliance.deploy.compiler.passes.int8_arith import rewrite_int8

    info = np.iinfo(dtype)
    rng = np.random.default_rng(0)
    x = rng.integers(info.min, info.max + 1, (1, 4, 9, 9)).astype(dtype)
    x[0, 0] = info.min  # a channel all at the lowest value: the padding must not win
    mod = qdq_pool_module(0.05, zero, dtype, requant)
    rewritten = rewrite_int8(mod)
    assert pools(rewritten, dtype) == [dtype] and pools(mod, dtype) == ["float32"]
    script = rewritten["main"].script()
    if requant is None:  # quantize(dequantize(x)) with the same scale and zero point is x itself
        assert "R.quantize" not in script and "R.dequantize" not in script, script
    np.testing.assert_array_equal(run(rewritten, x), run(mod, x))


def test_a_non_positive_scale_keeps_the_float_pool():
    from appliance.deploy.compiler.passes.int8_arith import rewrite_int8

    mod = qdq_pool_module(-0.05, 0, "int8")
    assert pools(rewrite_int8(mod), "int8") == ["float32"]
