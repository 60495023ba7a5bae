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


def run(mod, x, saturating=False):
    import tvm
    from tvm import relax

    from appliance.deploy.compiler.passes.legalize_fuse import legalize_and_fuse

    lowered = legalize_and_fuse(mod, saturating=saturating)
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


@pytest.mark.parametrize("zero, dtype", [(3, "int8"), (0, "int8"), (-128, "int8"), (127, "int8"), (0, "uint8"),
                                          (128, "uint8"), (255, "uint8")])
def test_the_saturating_form_gives_the_float_forms_values(zero, dtype):
    """aarch64's requantize (roundeven, fptosi.sat, saturating narrowing and zero-point add) against the
    float form, bit for bit: ties at halves, values far outside the range, infinities."""
    from tvm import relax

    scale = np.float32(0.5)
    halves = np.arange(-300, 300, dtype=np.float32) * np.float32(0.25)  # x / scale on every half and whole
    far = np.array([1e4, -1e4, 7e4, -7e4, 3e9, -3e9, 1e38, -1e38, np.inf, -np.inf, 16383.75, -16384.25], np.float32)
    rng = np.random.default_rng(2).normal(0, 80, 1024 - len(halves) - len(far)).astype(np.float32)
    x = np.concatenate([halves, far, rng]).reshape(1, 4, 16, 16)

    builder = relax.BlockBuilder()
    var = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with builder.function("main", [var]):
        with builder.dataflow():
            computed = builder.emit(relax.op.multiply(var, relax.const(np.float32(1))))  # as a layer's output is
            q = builder.emit(relax.op.quantize(computed, relax.const(scale), relax.const(np.array(zero, dtype)),
                                               axis=1, out_dtype=dtype))
            out = builder.emit_output(relax.op.astype(q, "float32"))
        builder.emit_func_output(out)
    mod = builder.get()
    script, got = run(mod, x, saturating=True)
    assert "llvm.fptosi.sat" in script and ("llvm.sadd.sat" in script) == (zero != 0), script
    _, expected = run(mod, x)
    lo, hi = (-128, 127) if dtype == "int8" else (0, 255)
    np.testing.assert_array_equal(expected, np.clip(np.round(x * np.float32(2)) + zero, lo, hi))
    np.testing.assert_array_equal(got, expected)


def test_the_model_inputs_quantize_keeps_the_float_form():
    """It runs in a scalar glue function, where saturating to 16 bits is compare-and-select."""
    script, _ = run(quantize_module(np.float32(0.0371)), np.zeros((1, 4, 8, 8), np.float32), saturating=True)
    assert "fptosi.sat" not in script and "T.round" in script, script
