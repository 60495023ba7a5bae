"""TVM in this process: how many threads its CPU runtime runs, and the fast import of its CPU intrinsics.

## Threads: the physical cores this process may use

TVM's runtime sizes its thread pool once, at the first parallel call in a process: TVM_NUM_THREADS,
else OMP_NUM_THREADS, else std::thread::hardware_concurrency(), halved on x86_64 on the assumption
that every core has two hyper-threads (src/runtime/threading_backend.cc, MaxConcurrency). On a
machine without SMT that is half the cores, and hardware_concurrency ignores the CPU affinity a
container or `taskset` gives the process. Measured on the 2-core Xeon VM here (no SMT): TVM ran
on one thread, MobileNetV2 int8 5.9 ms, 3.3 ms on both cores.

So before anything of ours runs a TVM library on this machine (the compile check, the host
latency, tuning), TVM_NUM_THREADS is set to the physical cores in this process's affinity: sibling
hyper-threads counted once (onnxruntime's default too), one per CPU where sysfs does not say.
A TVM_NUM_THREADS or OMP_NUM_THREADS the user set is left as it is. The edge runner on aarch64 is
not affected (TVM halves on x86_64 only).

## `cpu_tensor_intrinsics`
`tvm.s_tir.tensor_intrin`'s __init__ also registers CUDA, ROCm and Hexagon intrinsics (about 25 s
of a 30 s import); the kernels and tuning need only its x86 and ARM submodules.
"""

from __future__ import annotations

import importlib
import os
import sys
import types
from pathlib import Path

SYS_CPU = Path("/sys/devices/system/cpu")


def physical_cores(cpus=None, sys_cpu: Path = SYS_CPU) -> int:
    """The physical cores among `cpus` (default: this process's affinity): each (package, core)
    counted once; a CPU whose topology sysfs does not give counts as a core of its own."""
    cpus = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    cores = set()
    for cpu in cpus:
        topology = sys_cpu / f"cpu{cpu}" / "topology"
        try:
            cores.add((topology.joinpath("physical_package_id").read_text().strip(),
                       topology.joinpath("core_id").read_text().strip()))
        except OSError:
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def use_physical_cores() -> int | None:
    """Set TVM_NUM_THREADS to physical_cores() unless TVM_NUM_THREADS or OMP_NUM_THREADS is set;
    returns the count set, or None where the user's setting stays. Takes effect if no TVM parallel
    call has run in this process yet (TVM's pool is made once)."""
    if os.environ.get("TVM_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS"):
        return None
    count = physical_cores()
    os.environ["TVM_NUM_THREADS"] = str(count)
    return count


def cpu_tensor_intrinsics() -> None:
    """Import `tvm.s_tir.tensor_intrin` with only its x86 and ARM submodules (see the module docstring)."""
    import tvm.s_tir

    name = "tvm.s_tir.tensor_intrin"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(Path(tvm.s_tir.__file__).parent / "tensor_intrin")]
        sys.modules[name] = package
        for sub in ("x86", "arm_cpu"):
            importlib.import_module(f"{name}.{sub}")
