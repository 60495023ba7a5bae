"""The build targets, and one description of the CPU a build is for (`describe_cpu`), made once.

Every decision that depends on the CPU (which kernels a layer gets, how large their register tile
is, whether a dot-product instruction is there) reads the `CPU` here, not the TVM target: one place
to see what a target is, and to add one. TVM targets are JSON dicts (0.27 refuses CLI strings); the
x86_64 target is the host, its -mcpu filled in at compile time.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass

from appliance.core.errors import EnvironmentProblem

CROSS_COMPILER = "aarch64-linux-gnu-g++"
TARGETS = {
    "aarch64": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon"]},
    "aarch64-dotprod": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod"]},
    "aarch64-i8mm": {"kind": "llvm", "mtriple": "aarch64-linux-gnu", "mattr": ["+neon", "+dotprod", "+i8mm"]},
    "x86_64": {"kind": "llvm", "mtriple": "x86_64-linux-gnu"},  # mcpu: the host's, added at compile time
}
ELF_MACHINE = {"aarch64": 183, "x86_64": 62}
# The dot-product instructions a kernel may need (kernels.registry names them in `needs`), by the
# LLVM feature that says a CPU has it.
DOT_PRODUCTS = {"x86_64": ("avx512vnni",), "aarch64": ("dotprod", "i8mm")}


@dataclass(frozen=True)
class CPU:
    """What the kernels need to know about a build's CPU.

    vector: the vector unit the channel-vector kernels are sized for ("avx512", "avx2", "neon"),
    None where there is none they know; tile: (vector, blocks of 16 output channels, most output
    pixels) of their register tile, None without a vector unit; dot: the dot-product instructions
    (LLVM feature names, e.g. "avx512vnni", "dotprod") it has."""

    triple: str
    mcpu: str
    vector: str | None
    tile: tuple[str, int, int] | None
    dot: tuple[str, ...]

    def has(self, feature: str) -> bool:
        """Whether it has an instruction-set feature: a dot product, its vector unit by name, or
        "simd" (any vector unit the channel-vector kernels are sized for)."""
        return feature in self.dot or feature == self.vector or (feature == "simd" and self.vector is not None)

    def name(self) -> str:
        return f"{self.triple} {self.mcpu}".strip()


def target_for(name: str) -> dict:
    from tvm.target import codegen

    target = dict(TARGETS[name])
    if name == "x86_64":
        target["mcpu"] = codegen.llvm_get_system_cpu()
    return target


def check_cross_compiler() -> str:
    path = shutil.which(CROSS_COMPILER)
    if path is None:
        raise EnvironmentProblem(f"{CROSS_COMPILER}: cross compiler not found on PATH (install Debian's "
                                 "g++-aarch64-linux-gnu, e.g. `installer/bootstrap.sh --system`)")
    return path


def describe_cpu(tvm_target: dict) -> CPU:
    """The CPU of a TVM target dict (as target_for makes it), detected once per target."""
    return _describe(json.dumps(tvm_target, sort_keys=True))


@functools.cache
def _describe(key: str) -> CPU:
    target = json.loads(key)
    triple, mcpu = str(target.get("mtriple", "")), str(target.get("mcpu", ""))
    tile = _tile(target, triple, mcpu)
    return CPU(triple, mcpu, tile[0] if tile else None, tile, _dot_products(target, triple, mcpu))


def _features(target: dict, features: tuple) -> tuple[str, ...]:
    import tvm
    from tvm.target import codegen

    built = tvm.target.Target(target)
    return tuple(f for f in features if codegen.target_has_features(f, built))


def _tile(target: dict, triple: str, mcpu: str) -> tuple[str, int, int] | None:
    """The register tile of the channel-vector kernels (kernels/simd_conv.py) for this CPU."""
    if target.get("kind") != "llvm":
        return None
    if triple.startswith("aarch64"):
        return "neon", 1, 6  # 32 q registers: 24 accumulators, 4 for the weights, 1 broadcast
    if not triple.startswith("x86_64") or not mcpu:
        return None
    found = _features(target, ("avx512f", "avx2", "fma"))
    if "avx512f" in found:
        return "avx512", 2, 7  # 32 zmm: 14 accumulators, 2 weights; each broadcast feeds 2 FMAs
    if "avx2" in found and "fma" in found:
        return "avx2", 1, 6  # 16 ymm: 12 accumulators, 2 for the weights, 1 broadcast
    return None


def _dot_products(target: dict, triple: str, mcpu: str) -> tuple[str, ...]:
    if target.get("kind") != "llvm":
        return ()
    if triple.startswith("x86_64"):
        return _features(target, DOT_PRODUCTS["x86_64"]) if mcpu else ()
    if triple.startswith("aarch64"):  # what the target asks for: its -mattr (the device is not here to ask)
        return tuple(f for f in DOT_PRODUCTS["aarch64"] if f"+{f}" in (target.get("mattr") or []))
    return ()
