"""The aarch64 int8 convolution kernels, `sdot` (appliance/deploy/compiler/kernels/arm_dotprod.py) and
plain NEON `smull`/`smlal`/`sadalp` (kernels/arm_neon.py), run under qemu-aarch64 (`-cpu max` is its
default for user mode: dotprod and i8mm; the plain NEON builds also under `-cpu cortex-a72`, an
ARMv8.0 core that has neither): exact against an integer reference on awkward shapes, the same bits
as the x86 build, and the requantize handover into a depthwise kernel giving the NCHW handover's
bits. Whole models (small_cnn, ResNet-18, MobileNetV2 at 64 px) against the x86 build: test_int8.py."""

import json
import shutil
import subprocess

import numpy as np
import pytest

from appliance.deploy.compiler.passes.epilogue_fusion import fuse_epilogues
from appliance.deploy.compiler.passes.kernel_dispatch import lower_group
from appliance.deploy.compiler.passes.legalize_fuse import legalize_and_fuse
from appliance.deploy.compiler.targets import CROSS_COMPILER, TARGETS, describe_cpu, target_for

DOTPROD = TARGETS["aarch64-dotprod"]
# target -> (the instruction its int8 kernel must contain, its kernel's name, qemu's -cpu)
KERNEL_OF = {"aarch64-dotprod": ("sdot", "sdot_conv2d_", "max"), "aarch64": ("sadalp", "neon_conv2d_", "cortex-a72"),
             "aarch64-i8mm": ("smmla", "smmla_conv2d_", "max"), "aarch64-i8mm/sdot": ("sdot", "sdot_conv2d_", "max")}


@pytest.fixture(scope="module")
def edge_root(tmp_path_factory, edge_package):
    """An unpacked edge package: its native runner and TVM runtime run any aarch64 library under qemu."""
    from appliance.deploy.verify import unpack_checked

    return unpack_checked(edge_package, tmp_path_factory.mktemp("arm-int8-edge"))


def run_on_arm(edge_root, mod, x, tmp_path, target="aarch64-dotprod", monkeypatch=None):
    """mod (float32 input) built for `target` and run by the package's runner under qemu (the
    target's -cpu: an ARMv8.0 Cortex-A72 for plain aarch64, so no later instruction can slip in)."""
    import tvm

    from appliance.deploy.verify import DEFAULT_SYSROOT, run_native

    instruction, _, qemu_cpu = KERNEL_OF[target]
    library = tmp_path / "arm.so"
    tvm.compile(mod, target=tvm.target.Target(TARGETS[target.split("/")[0]])).export_library(
        str(library), fcompile=tvm.support.cc.cross_compiler(CROSS_COMPILER))
    disassembly = subprocess.run(["aarch64-linux-gnu-objdump", "-d", str(library)], capture_output=True, text=True,
                                 check=True).stdout
    assert f"\t{instruction}\t" in disassembly
    shutil.copyfile(library, edge_root / "model.so")
    model_json = json.loads((edge_root / "model.json").read_text())
    model_json["input"] = {**model_json["input"], "shape": list(x.shape)}
    (edge_root / "model.json").write_text(json.dumps(model_json))
    if monkeypatch is not None:
        monkeypatch.setenv("QEMU_CPU", qemu_cpu)  # qemu-user reads its -cpu from the environment too
    out, _ = run_native(edge_root, x, DEFAULT_SYSROOT)
    return out


def run_on_host(mod, x):
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(target_for("x86_64"))), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def conv_module(n, c, size, o, k, stride, dilation, pad, zero, low=-128):
    """float32 integers -> int8 -> pad with the zero point -> int8 conv2d with int32 sums -> float32
    (exact: every sum is below 2^24), the runner's float32 in and out. The runner feeds one sample a
    call: a batch of n comes in as one sample of n * c channels."""
    from tvm import relax

    w = np.random.default_rng(c * 100 + o + k).integers(low, 128, (o, c, k, k), dtype=np.int8)
    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType((1, n * c, size, size), "float32"))
    with builder.function("main", [data]):
        with builder.dataflow():
            xq = builder.emit(relax.op.astype(relax.op.reshape(data, (n, c, size, size)), "int8"))
            padded = builder.emit(relax.op.nn.pad(xq, [0, 0, 0, 0, pad, pad, pad, pad], pad_value=float(zero)))
            acc = builder.emit(relax.op.nn.conv2d(padded, relax.const(w), strides=[stride, stride],
                                                  dilation=[dilation, dilation], out_dtype="int32"))
            out = builder.emit_output(relax.op.astype(acc, "float32"))
        builder.emit_func_output(out)
    return builder.get(), w


# (batch, channels in, size, channels out, kernel, stride, dilation, padding): small, awkward
SHAPES = [
    (1, 16, 8, 32, 3, 1, 1, 1),   # a resnet block: 8 px wide, tiles of 4 pixels
    (1, 3, 11, 10, 5, 2, 1, 2),   # a stem: 3 channels (padded to 4), 10 outputs (not 16), odd size, tiles of 6
    (1, 24, 7, 40, 1, 1, 1, 0),   # 1x1 of 49 pixels, 40 outputs: tiles of 7, channels sliced back
    (2, 8, 12, 16, 3, 2, 2, 2),   # batch 2, stride 2 with dilation 2: 5 px wide
]


# (target, lowest weight): the NEON kernel pairs two products in int16 for weights in [-127, 127]
# (onnxruntime's symmetric int8) and widens each alone where a weight is -128
KERNEL_CASES = [("aarch64-dotprod", -128), ("aarch64", -127)]
HANDOVER_CASES = KERNEL_CASES + [("aarch64-i8mm", -128)]


# smmla takes 2 neighbouring pixels: horizontal stride 1, an even output width; the rest go to sdot
I8MM_SHAPES = [
    (1, 12, 10, 24, 3, 1, 2, 1),  # 3x3, 12 channels (padded to 16), 24 outputs, dilation 2: 4 pairs, tiles of 2
    (2, 24, 6, 40, 1, 1, 1, 0),   # batch 2, 1x1: 3 pairs a row, tiles of 1 pair, channels sliced back
    (1, 3, 11, 10, 5, 2, 1, 2),   # a stride-2 stem: on sdot
]
CASES = [(target, low, *shape) for target, low in KERNEL_CASES for shape in SHAPES] + [
    ("aarch64", -128, *shape) for shape in SHAPES[1:3]] + [  # unpaired: two shapes suffice, the code is the same
    ("aarch64-i8mm", -128, *shape) for shape in I8MM_SHAPES]


@pytest.mark.parametrize("target,low,n,c,size,o,k,stride,dilation,pad", CASES)
def test_int8_conv_on_arm_kernels_is_exact_under_qemu(edge_root, tmp_path, monkeypatch, target, low,
                                                        n, c, size, o, k, stride, dilation, pad):
    """One int8 conv2d on the target's kernel (sdot; plain NEON, paired or not), run under qemu: the
    integer reference (torch float64 on the same integers) and the x86 build (VNNI where the host has it).
    Activations of -128 everywhere they can be: the worst case of the int16 pairs."""
    import torch

    mod, w = conv_module(n, c, size, o, k, stride, dilation, pad, zero=-128, low=low)
    if target == "aarch64-i8mm" and stride != 1:
        target = "aarch64-i8mm/sdot"  # the smmla kernel declines, the sdot one takes it
    mod, count = lower_group(mod, describe_cpu(TARGETS[target.split("/")[0]]), "int8")
    assert count == 1 and f"{KERNEL_OF[target][1]}0" in [gv.name_hint for gv in mod.get_global_vars()]
    mod = fuse_epilogues(legalize_and_fuse(mod))[0]
    x = np.random.default_rng(size).integers(-128, 128, (n, c, size, size)).astype(np.float32)
    x[..., ::2, :] = -128
    got = run_on_arm(edge_root, mod, x.reshape(1, n * c, size, size), tmp_path, target, monkeypatch)
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=-128)
    expected = torch.nn.functional.conv2d(torch.from_numpy(xp), torch.from_numpy(w.astype(np.float64)),
                                          stride=stride, dilation=dilation).numpy()
    np.testing.assert_array_equal(got.reshape(expected.shape), expected)
    host_mod, _ = lower_group(conv_module(n, c, size, o, k, stride, dilation, pad, zero=-128, low=low)[0],
                              describe_cpu(target_for("x86_64")), "int8")
    np.testing.assert_array_equal(got.reshape(expected.shape), run_on_host(host_mod, x.reshape(1, n * c, size, size)))


def requantized_block(c, o, size, low=-128):
    """float32 -> int8 -> 1x1 conv -> requantize (as int8_arith writes it) -> pad with the zero point
    -> depthwise 3x3 -> float32: the chain the layout handover remakes on the blocked layout."""
    from tvm import relax

    rng = np.random.default_rng(c + o)
    w1 = rng.integers(low, 128, (o, c, 1, 1), dtype=np.int8)
    wd = rng.integers(-128, 128, (o, 1, 3, 3), dtype=np.int8)
    corr = rng.integers(-3000, 3000, (1, o, 1, 1)).astype(np.int32)
    scale = (rng.random((1, o, 1, 1)) * 1e-3).astype(np.float32)
    bias = rng.standard_normal((1, o, 1, 1)).astype(np.float32)
    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType((1, c, size, size), "float32"))
    with builder.function("main", [data]):
        with builder.dataflow():
            xq = builder.emit(relax.op.astype(data, "int8"))
            acc = builder.emit(relax.op.nn.conv2d(xq, relax.const(w1), out_dtype="int32"))
            acc = builder.emit(relax.op.subtract(acc, relax.const(corr)))
            real = builder.emit(relax.op.add(relax.op.multiply(relax.op.astype(acc, "float32"), relax.const(scale)),
                                             relax.const(bias)))
            q = builder.emit(relax.op.quantize(real, relax.const(0.05, "float32"), relax.const(-3, "int8"),
                                               axis=1, out_dtype="int8"))
            padded = builder.emit(relax.op.nn.pad(q, [0, 0, 0, 0, 1, 1, 1, 1], pad_value=-3.0))
            out = builder.emit(relax.op.nn.conv2d(padded, relax.const(wd), groups=o, out_dtype="int32"))
            out = builder.emit_output(relax.op.astype(out, "float32"))
        builder.emit_func_output(out)
    return builder.get()


@pytest.mark.parametrize("target,low", HANDOVER_CASES)
def test_the_arm_kernels_hand_their_requantized_output_to_the_depthwise_kernel(edge_root, tmp_path, monkeypatch,
                                                                                target, low):
    """The blocked handover (passes/layout_handover.py) from the sdot and NEON kernels: their blocked
    twins, the requantize in the write-back; under qemu the bits of the x86 build (NCHW handover on
    the host). The NEON int8 depthwise kernel (simd_depthwise.py, int32 sums) runs on the same path."""
    from appliance.deploy.compiler.passes.layout_handover import blocked_handoff

    c, o, size = 24, 32, 10
    cpu = describe_cpu(TARGETS[target])
    mod, depthwise = lower_group(requantized_block(c, o, size, low), cpu, "int8-depthwise")
    mod, convs = lower_group(mod, cpu, "int8")
    mod, handoffs = blocked_handoff(mod)
    assert (depthwise, convs, handoffs) == (1, 1, 1)
    assert any(gv.name_hint.startswith(f"{KERNEL_OF[target][1]}blocked_") for gv in mod.get_global_vars())
    mod, kernels, fused = fuse_epilogues(legalize_and_fuse(mod))
    assert kernels == fused == 2
    x = np.random.default_rng(3).integers(-128, 128, (1, c, size, size)).astype(np.float32)
    got = run_on_arm(edge_root, mod, x, tmp_path, target, monkeypatch)
    host = run_on_host(requantized_block(c, o, size, low), x)  # TVM's generic lowering on the host
    np.testing.assert_array_equal(got.reshape(host.shape), host)


def test_sdot_kernels_need_the_dotprod_target():
    from appliance.deploy.compiler.kernels.registry import kernels_for

    assert [k.name for k in kernels_for(describe_cpu(DOTPROD), "int8")] == ["sdot_conv2d_", "neon_conv2d_"]
    assert [k.name for k in kernels_for(describe_cpu(TARGETS["aarch64"]), "int8")] == ["neon_conv2d_"]
    assert [k.name for k in kernels_for(describe_cpu(TARGETS["aarch64-i8mm"]), "int8")] == [
        "smmla_conv2d_", "sdot_conv2d_", "neon_conv2d_"]
