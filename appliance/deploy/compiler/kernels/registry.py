"""The one registry of our kernels: their names, what CPU each needs, and which layers it computes.

To add a kernel (for a new instruction set, say ARM dot products): write its TIR and its lowering
in a module named for the instruction set (kernels/arm_dotprod.py), keeping the conventions of
kernels/common.py, and add one `Kernel` line to KERNELS below. Nothing else names a kernel: the
kernel dispatch pass tries the lowerings of each group in the order of KERNELS, for the kernels the
build's CPU (targets.py) has every feature of `needs`; the layout handover, the epilogue fusion and
compile.json's counts find a kernel in a module by `kernel_named`.

Groups, in the order kernel dispatch runs them:
- "int8-depthwise": int8 x int8 -> int32 depthwise conv2d (what passes/int8_arith.py makes);
- "int8": int8 x int8 -> int32 conv2d of groups 1 (and int8 matmuls, as 1x1 convolutions);
- "float32": float32 conv2d (and float32 matmuls with constant weights, as 1x1 convolutions).
A kernel with no lowering is made by a pass (the layout handover's blocked-output kernels).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from appliance.deploy.compiler.kernels import arm_dotprod, arm_i8mm, arm_neon, simd_conv, simd_depthwise, x86_avx512, x86_vnni

GROUPS = ("int8-depthwise", "int8", "float32")


@dataclass(frozen=True)
class Kernel:
    """name: the prefix of its PrimFuncs in a module (the layer's index follows); group: the layers
    it computes (GROUPS); needs: CPU features (targets.CPU.has; "simd": any vector unit the
    channel-vector kernels are sized for); lower(builder, call, index, cpu, name): the Relax
    expression that computes `call` on it, None where it does not apply; kind, label: how
    compile.json and the log name the kernels of its group on this CPU (None: the vector unit);
    pixels: 16 pixels a vector (its write-back is vectorised already); blocked: it writes
    [N, C/16, H, W, 16]; handover: the blocked kernel the layout handover remakes it as, where it
    feeds a depthwise kernel; make: an int8 blocked kernel's PrimFunc builder, its module's
    conv2d_kernel(n, c4, h, w, o16, kh, kw, stride, dilation, blocked_out=True)."""

    name: str
    group: str
    needs: tuple[str, ...]
    lower: Callable | None
    kind: str | None = None
    label: str | None = None
    pixels: bool = False
    blocked: bool = False
    handover: str | None = None
    make: Callable | None = None

    @property
    def dtype(self) -> str:
        return "float32" if self.group == "float32" else "int8"


KERNELS = (
    Kernel("depthwise_int8_", "int8-depthwise", ("simd",), simd_depthwise.lower_int8),
    Kernel("vnni_conv2d_pixels_", "int8", ("avx512vnni",), x86_vnni.lower_pixels, "x86-vnni", "AVX-512 VNNI",
           pixels=True, handover="vnni_conv2d_blocked_"),
    Kernel("vnni_conv2d_", "int8", ("avx512vnni",), x86_vnni.lower_conv2d, "x86-vnni", "AVX-512 VNNI",
           handover="vnni_conv2d_blocked_"),
    Kernel("vnni_conv2d_blocked_", "int8", ("avx512vnni",), None, "x86-vnni", blocked=True,
           make=x86_vnni.conv2d_kernel),
    Kernel("smmla_conv2d_", "int8", ("i8mm",), arm_i8mm.lower_conv2d, "arm-i8mm", "ARMv8.6 matrix multiply (smmla)",
           handover="smmla_conv2d_blocked_"),
    Kernel("smmla_conv2d_blocked_", "int8", ("i8mm",), None, "arm-i8mm", blocked=True, make=arm_i8mm.conv2d_kernel),
    Kernel("sdot_conv2d_", "int8", ("dotprod",), arm_dotprod.lower_conv2d, "arm-dotprod", "ARMv8.2 dot product (sdot)",
           handover="sdot_conv2d_blocked_"),
    Kernel("sdot_conv2d_blocked_", "int8", ("dotprod",), None, "arm-dotprod", blocked=True,
           make=arm_dotprod.conv2d_kernel),
    Kernel("neon_conv2d_", "int8", ("neon",), arm_neon.lower_conv2d, "arm-neon", "ARMv8.0 NEON (smull/smlal/sadalp)",
           handover="neon_conv2d_blocked_"),
    Kernel("neon_conv2d_blocked_", "int8", ("neon",), None, "arm-neon", blocked=True, make=arm_neon.blocked_kernel),
    Kernel("depthwise_float32_", "float32", ("simd",), simd_depthwise.lower_fp32),
    Kernel("fp32_conv2d_pixels_", "float32", ("avx512",), x86_avx512.lower_fp32, pixels=True,
           handover="fp32_conv2d_blocked_"),
    Kernel("fp32_conv2d_", "float32", ("simd",), simd_conv.lower_fp32, handover="fp32_conv2d_blocked_"),
    Kernel("fp32_conv2d_blocked_", "float32", ("simd",), None, blocked=True),
)
BY_NAME = {k.name: k for k in KERNELS}


def kernels_for(cpu, group: str) -> list[Kernel]:
    """The kernels of `group` with a lowering that `cpu` (targets.CPU) can run, in dispatch order."""
    return [k for k in KERNELS if k.group == group and k.lower is not None and all(cpu.has(f) for f in k.needs)]


def kernel_named(name: str) -> Kernel | None:
    """The kernel a PrimFunc of this name was made from (its registry name and the layer's index)."""
    prefix, _, index = name.rpartition("_")
    return BY_NAME.get(prefix + "_") if index.isdigit() else None


def blocked_kernel(kernel: Kernel) -> Kernel:
    return BY_NAME[kernel.handover]
