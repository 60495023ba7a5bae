"""The compiler's structure as its users rely on it: one CPU description, one kernel registry that
names every kernel, one ordered pass list. Fast: no builds (the builds are in test_compile.py,
test_cpu_conv.py, test_x86_int8.py and test_int8.py)."""

from appliance.deploy.compiler.kernels.registry import KERNELS, GROUPS, blocked_kernel, kernel_named, kernels_for
from appliance.deploy.compiler.pipeline import PASSES
from appliance.deploy.compiler.targets import TARGETS, describe_cpu


def test_the_cpu_description_names_vector_unit_tile_and_dot_products():
    vnni = describe_cpu({**TARGETS["x86_64"], "mcpu": "sapphirerapids"})
    assert (vnni.vector, vnni.tile, vnni.dot) == ("avx512", ("avx512", 2, 7), ("avx512vnni",))
    assert describe_cpu({**TARGETS["x86_64"], "mcpu": "znver3"}).dot == ()
    arm, dotprod = describe_cpu(TARGETS["aarch64"]), describe_cpu(TARGETS["aarch64-dotprod"])
    assert (arm.vector, arm.dot, dotprod.dot) == ("neon", (), ("dotprod",))
    assert dotprod.has("dotprod") and dotprod.has("simd") and not arm.has("dotprod")
    assert describe_cpu({**TARGETS["x86_64"], "mcpu": "sapphirerapids"}) is vnni  # detected once


def test_every_kernel_is_found_by_the_names_it_gives_its_functions():
    assert len({k.name for k in KERNELS}) == len(KERNELS)
    for kernel in KERNELS:
        assert kernel.group in GROUPS and kernel.name.endswith("_")
        assert kernel_named(f"{kernel.name}12") is kernel
        if kernel.handover:
            assert blocked_kernel(kernel).blocked and blocked_kernel(kernel).dtype == kernel.dtype
    assert kernel_named("fused_conv2d_add") is None and kernel_named("vnni_conv2d_blocked") is None


def test_dispatch_offers_each_cpu_the_kernels_it_can_run_most_specific_first():
    vnni = describe_cpu({**TARGETS["x86_64"], "mcpu": "sapphirerapids"})
    avx2 = describe_cpu({**TARGETS["x86_64"], "mcpu": "znver3"})
    arm = describe_cpu(TARGETS["aarch64-dotprod"])
    names = lambda cpu, group: [k.name for k in kernels_for(cpu, group)]  # noqa: E731
    assert names(vnni, "int8") == ["vnni_conv2d_pixels_", "vnni_conv2d_"]
    assert names(vnni, "float32") == ["depthwise_float32_", "fp32_conv2d_pixels_", "fp32_conv2d_"]
    assert names(avx2, "int8") == [] and names(avx2, "float32") == ["depthwise_float32_", "fp32_conv2d_"]
    assert names(arm, "int8-depthwise") == ["depthwise_int8_"]
    assert names(describe_cpu(TARGETS["x86_64"]), "float32") == []  # no CPU named: no assumption


def test_the_pipeline_is_one_ordered_list_of_named_passes():
    assert [name for name, _ in PASSES] == ["int8_arithmetic", "kernel_dispatch", "layout_handover",
                                            "legalize_and_fuse", "epilogue_fusion", "glue_scheduling", "tuning"]
