"""The x86_64 int8 convolution kernels with AVX-512 VNNI (appliance/deploy/compiler/kernels/x86_vnni.py): exact
against an integer reference on awkward shapes, chosen only where the build's CPU has the
instruction. The whole-model builds with them are checked against onnxruntime in test_int8.py."""

import numpy as np
import pytest

from appliance.deploy.compiler.passes.epilogue_fusion import fuse_epilogues
from appliance.deploy.compiler.passes.kernel_dispatch import lower_group
from appliance.deploy.compiler.passes.legalize_fuse import legalize_and_fuse
from appliance.deploy.compiler.targets import TARGETS, describe_cpu, target_for


def host_target():
    return target_for("x86_64")


def needs_vnni():
    if not describe_cpu(host_target()).has("avx512vnni"):
        pytest.skip(f"this CPU ({host_target().get('mcpu')}) has no AVX-512 VNNI: the generic kernels are used")


def test_vnni_is_chosen_by_the_build_cpu_not_by_the_machine_compiling():
    assert describe_cpu({**TARGETS["x86_64"], "mcpu": "sapphirerapids"}).has("avx512vnni")
    assert not describe_cpu({**TARGETS["x86_64"], "mcpu": "znver3"}).has("avx512vnni")  # AVX2 only
    assert not describe_cpu({**TARGETS["x86_64"], "mcpu": "skylake-avx512"}).has("avx512vnni")  # AVX-512 without VNNI
    assert not describe_cpu(TARGETS["x86_64"]).has("avx512vnni")  # no CPU named: no assumption
    assert not describe_cpu(TARGETS["aarch64-dotprod"]).has("avx512vnni")


# (batch, channels in, size, channels out, kernel, stride, dilation, padding, the kernel it gets)
SHAPES = [
    (1, 64, 14, 64, 3, 1, 1, 1, "vnni_conv2d_0"),   # a resnet block
    (2, 3, 17, 10, 7, 2, 1, 3, "vnni_conv2d_0"),    # a stem: 3 channels (padded to 4), 10 outputs (not 16), batch 2, odd size
    (1, 24, 9, 40, 1, 1, 1, 0, "vnni_conv2d_0"),    # 1x1 of 81 pixels: not whole vectors of 16
    (1, 8, 12, 16, 3, 2, 2, 2, "vnni_conv2d_0"),    # stride 2 with dilation 2
    # 1x1 with 16 pixels a vector (x86_vnni.pixels_kernel): 22 channels (padded to 24), batch 2, tiles of 6 x 2
    (2, 22, 8, 24, 1, 1, 1, 0, "vnni_conv2d_pixels_0"),
    (1, 16, 28, 96, 1, 1, 1, 0, "vnni_conv2d_pixels_0"),  # MobileNetV2's expansion at 28x28: 49 vectors, tiles of 12 x 1
]


@pytest.mark.parametrize("n,c,size,o,k,stride,dilation,pad,kernel", SHAPES)
def test_int8_conv_on_vnni_is_exact(n, c, size, o, k, stride, dilation, pad, kernel):
    """A Relax int8 x int8 -> int32 conv2d (what int8_rewrite emits, padding explicit) on the VNNI
    kernel, built and run, against torch's float64 convolution of the same integers."""
    needs_vnni()
    import torch
    import tvm
    from tvm import relax


    rng = np.random.default_rng(n * 1000 + c * 10 + k)
    x = rng.integers(-128, 128, (n, c, size, size), dtype=np.int8)
    w = rng.integers(-128, 128, (o, c, k, k), dtype=np.int8)
    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType((n, c, size, size), "int8"))
    with builder.function("main", [data]):
        with builder.dataflow():
            padded = builder.emit(relax.op.nn.pad(data, [0, 0, 0, 0, pad, pad, pad, pad], pad_value=-7.0))
            out = builder.emit_output(relax.op.nn.conv2d(padded, relax.const(w), strides=[stride, stride],
                                                         dilation=[dilation, dilation], out_dtype="int32"))
        builder.emit_func_output(out)
    mod, count = lower_group(builder.get(), describe_cpu(host_target()), "int8")
    assert count == 1
    assert kernel in [gv.name_hint for gv in mod.get_global_vars()]
    mod, kernels, fused = fuse_epilogues(legalize_and_fuse(mod))  # as compile does: the correction after it, in its write-back
    assert (kernels, fused) == (1, 1)
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x)).numpy()
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-7)
    expected = torch.nn.functional.conv2d(torch.from_numpy(xp), torch.from_numpy(w.astype(np.float64)),
                                          stride=stride, dilation=dilation).numpy()
    assert got.dtype == np.int32 and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected.astype(np.int64))


def test_grouped_and_float_convolutions_are_left_alone():
    from tvm import relax


    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType((1, 8, 6, 6), "int8"))
    fdata = relax.Var("f", relax.TensorType((1, 8, 6, 6), "float32"))
    with builder.function("main", [data, fdata]):
        with builder.dataflow():
            depthwise = builder.emit(relax.op.nn.conv2d(data, relax.const(np.ones((8, 1, 3, 3), np.int8)), groups=8,
                                                        out_dtype="int32"))
            floating = builder.emit(relax.op.nn.conv2d(fdata, relax.const(np.ones((4, 8, 1, 1), np.float32))))
            out = builder.emit_output(relax.Tuple([depthwise, floating]))
        builder.emit_func_output(out)
    _, count = lower_group(builder.get(), describe_cpu(host_target()), "int8")
    assert count == 0


def requantized_block(c: int, o: int, size: int, residual: bool):
    """conv 1x1 int8 -> the requantize int8_rewrite emits (zero-point correction, per-channel scale
    and bias, quantize) -> pad with the zero point -> depthwise 3x3 int8; with `residual`, the
    requantized tensor is read a second time (added to the depthwise output)."""
    from tvm import relax

    rng = np.random.default_rng(c + o)
    w1 = rng.integers(-128, 128, (o, c, 1, 1), dtype=np.int8)
    wd = rng.integers(-128, 128, (o, 1, 3, 3), dtype=np.int8)
    corr = rng.integers(-3000, 3000, (1, o, 1, 1)).astype(np.int32)
    scale = (rng.random((1, o, 1, 1)) * 1e-3).astype(np.float32)
    bias = rng.standard_normal((1, o, 1, 1)).astype(np.float32)
    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType((1, c, size, size), "int8"))
    with builder.function("main", [data]):
        with builder.dataflow():
            acc = builder.emit(relax.op.nn.conv2d(data, relax.const(w1), out_dtype="int32"))
            acc = builder.emit(relax.op.subtract(acc, relax.const(corr)))
            real = builder.emit(relax.op.add(relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(scale)),
                                             relax.const(bias)))
            q = builder.emit(relax.op.quantize(real, relax.const(0.05, "float32"), relax.const(-3, "int8"),
                                               axis=1, out_dtype="int8"))
            padded = builder.emit(relax.op.nn.pad(q, [0, 0, 0, 0, 1, 1, 1, 1], pad_value=-3.0))
            out = builder.emit(relax.op.nn.conv2d(padded, relax.const(wd), groups=o, out_dtype="int32"))
            if residual:
                out = builder.emit(relax.op.add(out, relax.op.astype(q, "int32")))
            out = builder.emit_output(out)
        builder.emit_func_output(out)
    return builder.get()


@pytest.mark.parametrize("c,o,size", [(16, 96, 16), (24, 32, 14)])
def test_a_1x1_conv_hands_its_output_to_the_depthwise_kernel_in_its_layout(c, o, size):
    """The blocked handover (cpu_handoff.py): the 1x1 VNNI kernel writes [N, C/16, H, W, 16], the
    requantize runs on that layout and only the padding is left before the depthwise kernel; the
    outputs are the bits of the NCHW handover. 16x16: the pixel kernel's conv remade; 14x14: the
    channel kernel's."""
    needs_vnni()
    import tvm
    from tvm import relax

    from appliance.deploy.compiler.passes.layout_handover import blocked_handoff

    x = np.random.default_rng(1).integers(-128, 128, (1, c, size, size), dtype=np.int8)
    outputs = []
    for handoff in (False, True):
        mod, depthwise = lower_group(requantized_block(c, o, size, residual=False), describe_cpu(host_target()), "int8-depthwise")
        mod, convs = lower_group(mod, describe_cpu(host_target()), "int8")
        assert (depthwise, convs) == (1, 1)
        if handoff:
            mod, count = blocked_handoff(mod)
            assert count == 1
            names = [gv.name_hint for gv in mod.get_global_vars()]
            assert any(name.startswith("vnni_conv2d_blocked_") for name in names)
            assert not any(name.startswith(("vnni_conv2d_pixels_", "vnni_conv2d_0")) for name in names)
        mod, kernels, fused = fuse_epilogues(legalize_and_fuse(mod))
        assert kernels == fused == 2
        vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
        outputs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_array_equal(outputs[1], outputs[0])


def test_a_requantized_tensor_read_twice_keeps_the_nchw_handover():
    needs_vnni()
    from appliance.deploy.compiler.passes.layout_handover import blocked_handoff

    mod, _ = lower_group(requantized_block(16, 32, 16, residual=True), describe_cpu(host_target()), "int8-depthwise")
    mod, _ = lower_group(mod, describe_cpu(host_target()), "int8")
    assert blocked_handoff(mod)[1] == 0
