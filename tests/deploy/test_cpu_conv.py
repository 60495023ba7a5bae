"""The register-tiled float32 and depthwise kernels (appliance/deploy/compiler/kernels/simd_conv.py,
simd_depthwise.py, x86_avx512.py): against torch's
float64 convolution on awkward shapes, with every CPU's tile built and run on this host (the tiles
differ in size only; LLVM legalises the vectors for whichever CPU runs them). The whole-model
builds with them are checked against onnxruntime in test_compile.py and, under qemu, the package
and edge tests."""

import numpy as np
import pytest

from appliance.deploy.compiler.passes.epilogue_fusion import fuse_epilogues
from appliance.deploy.compiler.passes.kernel_dispatch import lower_group
from appliance.deploy.compiler.passes.legalize_fuse import legalize_and_fuse
from appliance.deploy.compiler.targets import CPU, TARGETS, describe_cpu, target_for


def cpu_with(tile):
    """An x86_64 CPU description with this register tile (vector unit tile[0]) and no dot products."""
    return CPU("x86_64-linux-gnu", "", tile[0], tile, ())


def host_target():
    return target_for("x86_64")


def test_the_tile_is_chosen_by_the_build_cpu_not_by_the_machine_compiling():
    assert describe_cpu({**TARGETS["x86_64"], "mcpu": "sapphirerapids"}).tile == ("avx512", 2, 7)
    assert describe_cpu({**TARGETS["x86_64"], "mcpu": "znver3"}).tile == ("avx2", 1, 6)
    assert describe_cpu({**TARGETS["x86_64"], "mcpu": "nehalem"}).tile is None  # SSE only: TVM's generic kernels
    assert describe_cpu(TARGETS["x86_64"]).tile is None  # no CPU named: no assumption
    assert describe_cpu(TARGETS["aarch64"]).tile == ("neon", 1, 6)
    assert describe_cpu(TARGETS["aarch64-dotprod"]).tile == ("neon", 1, 6)


TILES = [("avx512", 2, 7), ("avx2", 1, 6), ("neon", 1, 6)]
# (batch, channels in, size, channels out, kernel, stride, dilation, padding (top, left, bottom, right))
SHAPES = [
    (1, 64, 14, 64, 3, 1, 1, (1, 1, 1, 1)),   # a resnet block: 4 blocks of 16 outputs
    (2, 3, 17, 10, 7, 2, 1, (3, 3, 3, 3)),    # a stem: 10 outputs (padded to 16, one block), batch 2, odd size
    (1, 24, 9, 48, 1, 1, 1, (0, 0, 0, 0)),    # 1x1, 3 blocks (odd: one block per tile)
    (1, 8, 12, 32, 3, 2, 2, (2, 1, 0, 2)),    # stride 2, dilation 2, uneven padding
    (2, 20, 8, 30, 1, 1, 1, (0, 0, 0, 0)),    # 1x1 of 64 pixels: AVX-512 puts 16 pixels in a vector (x86_avx512.py)
]


def run_conv(x, w, stride, dilation, padding, groups, tile, out_dtype=None):
    """A Relax conv2d of x with constant w through the float32 or int8 depthwise kernel dispatch, built for this host and run."""
    import tvm
    from tvm import relax


    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType(x.shape, str(x.dtype)))
    with builder.function("main", [data]):
        with builder.dataflow():
            out = builder.emit_output(relax.op.nn.conv2d(data, relax.const(w), strides=[stride, stride],
                                                         padding=list(padding), dilation=[dilation, dilation],
                                                         groups=groups, out_dtype=out_dtype))
        builder.emit_func_output(out)
    mod, count = lower_group(builder.get(), cpu_with(tile), "int8-depthwise" if x.dtype == np.int8 else "float32")
    assert count == 1
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
    return vm["main"](tvm.runtime.tensor(x)).numpy()


def reference(x, w, stride, dilation, padding, groups):
    import torch

    top, left, bottom, right = padding
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (top, bottom), (left, right)))
    return torch.nn.functional.conv2d(torch.from_numpy(xp), torch.from_numpy(w.astype(np.float64)),
                                      stride=stride, dilation=dilation, groups=groups).numpy()


@pytest.mark.parametrize("tile", TILES, ids=[t[0] for t in TILES])
@pytest.mark.parametrize("n,c,size,o,k,stride,dilation,padding", SHAPES)
def test_float32_conv_matches_a_float64_reference(n, c, size, o, k, stride, dilation, padding, tile):
    rng = np.random.default_rng(n * 1000 + c * 10 + k)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = rng.standard_normal((o, c, k, k)).astype(np.float32)
    got = run_conv(x, w, stride, dilation, padding, 1, tile)
    expected = reference(x, w, stride, dilation, padding, 1)
    assert got.dtype == np.float32 and got.shape == expected.shape
    # float32 sums of c*k*k unit products, in another order than the reference's
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.sqrt(c * k * k) * 10)


# (batch, channels, size, kernel, stride, padding): 24 channels are 1.5 blocks of 16
DEPTHWISE = [(1, 32, 14, 3, 1, (1, 1, 1, 1)), (2, 24, 15, 3, 2, (1, 1, 1, 1)), (1, 16, 8, 5, 1, (2, 2, 2, 2))]


@pytest.mark.parametrize("n,c,size,k,stride,padding", DEPTHWISE)
def test_depthwise_float32_and_int8_match_the_reference(n, c, size, k, stride, padding):
    tile = host_tile()
    rng = np.random.default_rng(c * 10 + k)
    x = rng.standard_normal((n, c, size, size)).astype(np.float32)
    w = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    got = run_conv(x, w, stride, 1, padding, c, tile)
    np.testing.assert_allclose(got, reference(x, w, stride, 1, padding, c), rtol=0, atol=1e-5)
    # int8 x int8 -> int32, as int8_rewrite emits it (its padding is explicit, with the zero point): exact
    xq = rng.integers(-128, 128, (n, c, size, size), dtype=np.int8)
    wq = rng.integers(-128, 128, (c, 1, k, k), dtype=np.int8)
    got = run_conv(xq, wq, stride, 1, padding, c, tile, out_dtype="int32")
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, reference(xq, wq, stride, 1, padding, c).astype(np.int64))


def host_tile():
    return describe_cpu(host_target()).tile or ("avx2", 1, 6)


def test_other_convolutions_are_left_alone():
    """Grouped (not depthwise), runtime weights, and int8 data with groups 1 (VNNI's or generic) stay
    as they are."""
    from tvm import relax


    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType((1, 8, 6, 6), "float32"))
    weight = relax.Var("w", relax.TensorType((8, 8, 3, 3), "float32"))
    qdata = relax.Var("q", relax.TensorType((1, 8, 6, 6), "int8"))
    with builder.function("main", [data, weight, qdata]):
        with builder.dataflow():
            grouped = builder.emit(relax.op.nn.conv2d(data, relax.const(np.ones((8, 4, 3, 3), np.float32)), groups=2))
            runtime = builder.emit(relax.op.nn.conv2d(data, weight))
            plain = builder.emit(relax.op.nn.conv2d(qdata, relax.const(np.ones((8, 8, 3, 3), np.int8)), out_dtype="int32"))
            out = builder.emit_output(relax.Tuple([grouped, runtime, plain]))
        builder.emit_func_output(out)
    assert lower_group(builder.get(), cpu_with(host_tile()), "float32")[1] == 0
    assert lower_group(builder.get(), cpu_with(host_tile()), "int8-depthwise")[1] == 0


def test_a_float_model_says_which_kernels_it_got(tmp_path):
    """compile.json names the float32 kernels; --fp32-kernels generic turns them off, with the
    same outputs within the float tolerance."""
    import torch

    from appliance.deploy.compiler.driver import compile_model

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 20, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(20, 20, 3, padding=1, groups=20), torch.nn.ReLU(),
                                torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(20, 5)).eval()
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, torch.zeros(1, 3, 16, 16), str(path), input_names=["input"], output_names=["logits"],
                      dynamo=False)
    lines = []
    tiled = compile_model(path, "x86_64", tmp_path / "tiled", log=lines.append)
    tile = describe_cpu(host_target()).tile
    if tile:
        # both convolutions, and the classifier as a 1x1 convolution (cpu_dense.py)
        assert tiled["fp32_kernels"] == {"kind": tile[0], "layers": 3, "matmuls": 1, "pixels": 0, "handoffs": 0,
                                         "reason": None}
        assert any("3 of 3 float32 layers" in line and "1 of them matmuls" in line for line in lines), lines
    else:
        assert tiled["fp32_kernels"]["kind"] == "generic" and tiled["fp32_kernels"]["reason"]
    generic = compile_model(path, "x86_64", tmp_path / "generic", fp32_kernels="generic", log=lambda line: None)
    assert generic["fp32_kernels"] == {"kind": "generic", "layers": 0, "matmuls": 0, "pixels": 0, "handoffs": 0,
                                       "reason": "--fp32-kernels generic"}
    assert tiled["check"]["passed"] and generic["check"]["passed"]


def test_a_classifier_of_several_rows_runs_on_the_conv_kernels(tmp_path):
    """matmul(x [M, K], W) as a 1x1 convolution with the M rows as its batch (cpu_dense.py): a batch of
    3 through a Linear of 70 -> 37 outputs (not a whole number of 16-channel vectors) matches onnxruntime."""
    import torch

    from appliance.deploy.compiler.driver import compile_model

    if not describe_cpu(host_target()).tile:
        pytest.skip("this CPU has no vector unit the float32 kernels are sized for")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 5 * 5, 70), torch.nn.ReLU(),
                                torch.nn.Linear(70, 37)).eval()
    path = tmp_path / "model.onnx"
    torch.onnx.export(model, torch.zeros(3, 3, 5, 5), str(path), input_names=["input"], output_names=["logits"],
                      dynamo=False)
    info = compile_model(path, "x86_64", tmp_path / "tvm", batch=3, log=lambda line: None)
    assert info["fp32_kernels"]["matmuls"] == 2 and info["fp32_kernels"]["layers"] == 2
    assert info["check"]["passed"] and info["input"]["shape"] == [3, 3, 5, 5]


@pytest.mark.parametrize("channels", [32, 24])
def test_the_ops_after_a_kernel_run_in_its_write_back(channels):
    """bias + residual add + ReLU6 after a float32 conv: FuseOps joins them to the kernel and
    fuse_epilogues computes them on the tile before it is stored, so no function of the built module
    but the padding reads the kernel's output again. 32 channels: the vector write-back; 24 (1.5
    blocks, each channel bounds-checked): the scalar one. Against torch's float64 ops."""
    import torch
    import tvm
    from tvm import relax


    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 16, 10, 10)).astype(np.float32)
    skip = rng.standard_normal((1, channels, 10, 10)).astype(np.float32)
    w = rng.standard_normal((channels, 16, 3, 3)).astype(np.float32) * 0.2
    bias = rng.standard_normal((1, channels, 1, 1)).astype(np.float32)
    builder = relax.BlockBuilder()
    data, residual = relax.Var("x", relax.TensorType(x.shape, "float32")), relax.Var("r", relax.TensorType(skip.shape, "float32"))
    with builder.function("main", [data, residual]):
        with builder.dataflow():
            conv = builder.emit(relax.op.nn.conv2d(data, relax.const(w), padding=[1, 1, 1, 1]))
            summed = builder.emit(relax.op.add(relax.op.add(conv, relax.const(bias)), residual))
            out = builder.emit_output(relax.op.clip(summed, 0.0, 6.0))
        builder.emit_func_output(out)
    mod, count = lower_group(builder.get(), cpu_with(host_tile()), "float32")
    assert count == 1
    mod, kernels, fused = fuse_epilogues(legalize_and_fuse(mod))
    assert (kernels, fused) == (1, 1)
    called = [f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(called) == 2  # the input's padding, and the kernel with add, add and clip in it
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(skip)).numpy()
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double(), padding=1)
    ref = (ref + torch.from_numpy(bias).double() + torch.from_numpy(skip).double()).clamp(0, 6).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_glue_runs_on_all_cores_and_gives_the_same_bits():
    """A pad + reshape + transpose into a blocked layout (what feeds a depthwise kernel) becomes one
    parallel loop nest (cpu_glue.py); a reduction next to it is left alone; the outputs are the bits
    of TVM's default lowering."""
    import tvm
    from tvm import relax, tirx

    from appliance.deploy.compiler.passes.glue_schedule import schedule_glue

    builder = relax.BlockBuilder()
    x = relax.Var("x", relax.TensorType((1, 32, 56, 56), "float32"))
    with builder.function("main", [x]):
        with builder.dataflow():
            padded = builder.emit(relax.op.nn.pad(x, [0, 0, 0, 0, 1, 1, 1, 1], pad_value=0.0))
            blocked = builder.emit(relax.op.permute_dims(relax.op.reshape(padded, (1, 2, 16, 58, 58)), [0, 1, 3, 4, 2]))
            pooled = builder.emit(relax.op.mean(x, axis=[2, 3], keepdims=True))
            out = builder.emit_output(relax.Tuple([blocked, pooled]))
        builder.emit_func_output(out)
    plain = relax.get_pipeline("zero")(builder.get())
    scheduled, count = schedule_glue(relax.get_pipeline("zero")(builder.get()))
    assert count == 1
    funcs = {gv.name_hint: f for gv, f in scheduled.functions_items() if isinstance(f, tirx.PrimFunc)}
    glue = [f for name, f in funcs.items() if "transpose" in name]
    assert len(glue) == 1 and "T.parallel" in glue[0].script()
    assert not any("T.parallel" in f.script() for name, f in funcs.items() if "mean" in name)
    data = np.random.default_rng(0).standard_normal((1, 32, 56, 56)).astype(np.float32)
    outputs = []
    for mod in (plain, scheduled):
        vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
        outputs.append([o.numpy() for o in vm["main"](tvm.runtime.tensor(data))])
    assert all(np.array_equal(a, b) for a, b in zip(*outputs))
    np.testing.assert_array_equal(outputs[1][0][0, 1, 1:-1, 1:-1, 3], data[0, 19])


def test_a_1x1_conv_puts_pixels_in_the_vectors_and_its_epilogue_in_the_write_back():
    """A 1x1 float32 conv of stride 1 over whole vectors of 16 pixels, on an AVX-512 build: the
    pixel kernel (x86_avx512.py), with the bias, residual add and ReLU6 computed in its vectorised
    write-back; one function in all. Against torch's float64 ops. Other CPUs keep the channel kernels."""
    import torch
    import tvm
    from tvm import relax


    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 24, 8, 12)).astype(np.float32)  # 96 pixels: 6 vectors
    skip = rng.standard_normal((1, 36, 8, 12)).astype(np.float32)
    w = rng.standard_normal((36, 24, 1, 1)).astype(np.float32) * 0.2
    bias = rng.standard_normal((1, 36, 1, 1)).astype(np.float32)
    builder = relax.BlockBuilder()
    data, residual = relax.Var("x", relax.TensorType(x.shape, "float32")), relax.Var("r", relax.TensorType(skip.shape, "float32"))
    with builder.function("main", [data, residual]):
        with builder.dataflow():
            conv = builder.emit(relax.op.nn.conv2d(data, relax.const(w)))
            summed = builder.emit(relax.op.add(relax.op.add(conv, relax.const(bias)), residual))
            out = builder.emit_output(relax.op.clip(summed, 0.0, 6.0))
        builder.emit_func_output(out)
    for tile, kernel in ((("avx2", 1, 6), "fp32_conv2d_0"), (("avx512", 2, 7), "fp32_conv2d_pixels_0")):
        mod, count = lower_group(builder.get(), cpu_with(tile), "float32")
        assert count == 1 and kernel in [gv.name_hint for gv in mod.get_global_vars()]
    mod, kernels, fused = fuse_epilogues(legalize_and_fuse(mod))  # the AVX-512 one
    assert (kernels, fused) == (1, 1)
    called = [f for gv, f in mod.functions_items() if isinstance(f, tvm.tirx.PrimFunc)]
    assert len(called) == 1  # the kernel with add, add and clip in it
    vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
    got = vm["main"](tvm.runtime.tensor(x), tvm.runtime.tensor(skip)).numpy()
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).double(), torch.from_numpy(w).double())
    ref = (ref + torch.from_numpy(bias).double() + torch.from_numpy(skip).double()).clamp(0, 6).numpy()
    np.testing.assert_allclose(got, ref, atol=1e-4)


def test_the_pixel_tile_divides_channels_and_pixels():
    from appliance.deploy.compiler.kernels.x86_avx512 import tile

    assert tile(96, 112 * 112) == (6, 2)  # 14 accumulators at most: 6 channels x 2 vectors of 16 pixels
    assert tile(24, 28 * 28) == (12, 1)  # 49 vectors: one per tile
    assert tile(7, 4 * 16) == (7, 2)
    assert tile(7, 16) == (7, 1)  # 7 accumulators: fewer than 8, but the largest tile there is
    assert tile(2, 7 * 16) == (2, 7)  # the only tile of 6 or more
    assert tile(16, 14 * 14) is None  # 196 pixels: not whole vectors
    assert tile(5, 16) is None  # 5 accumulators: the channel kernels do better


@pytest.mark.parametrize("k", [32, 33])
def test_int8_depthwise_sums_stay_exact_at_the_float_limit(k):
    """int8 depthwise on AVX-512 sums in float32, exact for up to 1024 taps (sums of 127 x 127 stay
    below 2^24); a 33x33 filter (1089 taps) keeps int32 sums: its odd sum of 17.6 M is above 2^24,
    where float32 has only even numbers."""
    if host_tile()[0] != "avx512":
        pytest.skip("the float32 sums are for AVX-512 builds")
    x = np.full((1, 16, k, k), -127, np.int8)
    w = np.full((16, 1, k, k), -127, np.int8)
    got = run_conv(x, w, 1, 1, (0, 0, 0, 0), 16, host_tile(), out_dtype="int32")
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.full((1, 16, 1, 1), k * k * 127 * 127))


@pytest.mark.parametrize("k,stride,size", [(1, 1, 16), (3, 2, 29)])
def test_a_float32_conv_hands_its_output_to_the_depthwise_kernel_in_its_layout(k, stride, size):
    """conv -> bias -> ReLU6 -> pad -> depthwise (a MobileNetV2 block; 3x3 stride 2: its stem) with
    the conv writing the depthwise kernel's blocked layout (cpu_handoff.py), against the same
    module handing over NCHW: the same values. One function less: no layout pass between them."""
    import tvm
    from tvm import relax

    from appliance.deploy.compiler.passes.layout_handover import blocked_handoff

    rng = np.random.default_rng(k)
    x = rng.standard_normal((1, 8, size, size)).astype(np.float32)
    w = rng.standard_normal((32, 8, k, k)).astype(np.float32) * 0.3
    bias = rng.standard_normal((1, 32, 1, 1)).astype(np.float32)
    wd = rng.standard_normal((32, 1, 3, 3)).astype(np.float32)
    builder = relax.BlockBuilder()
    data = relax.Var("x", relax.TensorType(x.shape, "float32"))
    with builder.function("main", [data]):
        with builder.dataflow():
            conv = builder.emit(relax.op.nn.conv2d(data, relax.const(w), strides=[stride, stride]))
            act = builder.emit(relax.op.clip(relax.op.add(conv, relax.const(bias)), 0.0, 6.0))
            out = builder.emit_output(relax.op.nn.conv2d(act, relax.const(wd), padding=[1, 1, 1, 1], groups=32))
        builder.emit_func_output(out)
    outputs, functions = [], []
    for handoff in (False, True):
        mod, count = lower_group(builder.get(), cpu_with(host_tile()), "float32")
        assert count == 2
        if handoff:
            mod, count = blocked_handoff(mod, host_tile())
            assert count == 1
        mod, kernels, fused = fuse_epilogues(legalize_and_fuse(mod))
        assert (kernels, fused) == (2, 1)  # the conv with its bias and ReLU6; nothing after the depthwise
        functions.append(sum(isinstance(f, tvm.tirx.PrimFunc) for _, f in mod.functions_items()))
        vm = relax.VirtualMachine(tvm.compile(mod, target=tvm.target.Target(host_target())), tvm.cpu())
        outputs.append(vm["main"](tvm.runtime.tensor(x)).numpy())
    np.testing.assert_allclose(outputs[1], outputs[0], rtol=0, atol=1e-5)
    assert functions[1] <= functions[0]
