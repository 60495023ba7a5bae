"""The requantize of int8 builds (passes/legalize_fuse.py): quantize by a constant float32 scalar scale
multiplies by its reciprocal (no division in the generated code); any other scale keeps TVM's division."""

import numpy as np
import pytest


def quantize_module(scale, zero=3, shape=(1, 4, 8, 8)):
    from tvm import relax

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType(shape, "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            q = builder.emit(relax.op.quantize(x, relax.const(scale), relax.const(np.int8(zero) if np.ndim(scale) == 0
                                                                                    else np.full(np.shape(scale), zero, np.int8)),
                                               axis=1, out_dtype="int8"))
            out = builder.emit_output(relax.op.astype(q, "float32"))
        builder.emit_func_output(out)
    return builder.get()


def run(mod, x):
    import tvm
    from tvm import relax

    from appliance.deploy.compiler.passes.legalize_fuse import legalize_and_fuse

    lowered = legalize_and_fuse(mod)
    vm = relax.VirtualMachine(tvm.compile(lowered, target="llvm"), tvm.cpu())
    return lowered.script(), vm["main"](tvm.runtime.tensor(x)).numpy()


def test_a_scalar_scale_is_a_multiply_by_its_reciprocal():
    scale = np.float32(0.0371)
    x = np.random.default_rng(0).normal(0, 3, (1, 4, 8, 8)).astype(np.float32)
    script, got = run(quantize_module(scale), x)
    assert " / " not in script and "T.Div" not in script, script
    np.testing.assert_array_equal(got, np.clip(np.round(x * (np.float32(1) / scale)) + 3, -128, 127))
    # against the division: one step apart at most, and only where x / scale lies next to a half
    by_division = np.clip(np.round(x / scale) + 3, -128, 127)
    assert np.abs(got - by_division).max() <= 1
    assert (got != by_division).mean() < 0.01


@pytest.mark.parametrize("scale", [np.array([0.5, 0.25, 0.1, 0.3], np.float32)])
def test_a_per_channel_scale_keeps_tvms_division(scale):
    x = np.random.default_rng(1).normal(0, 3, (1, 4, 8, 8)).astype(np.float32)
    script, got = run(quantize_module(scale), x)
    assert " / " in script, script
    np.testing.assert_array_equal(got, np.clip(np.round(x / scale.reshape(1, 4, 1, 1)) + 3, -128, 127))
