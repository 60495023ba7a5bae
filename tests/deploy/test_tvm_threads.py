"""TVM's CPU runtime runs on every physical core the process may use (appliance/deploy/compiler/runtime.py):
TVM alone halves hardware_concurrency on x86_64, which on a machine without hyper-threads is half
the cores."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.deploy.compiler.runtime import physical_cores

ROOT = Path(__file__).resolve().parents[2]


def fake_topology(tmp_path, cores_of: dict):
    for cpu, (package, core) in cores_of.items():
        topology = tmp_path / f"cpu{cpu}" / "topology"
        topology.mkdir(parents=True)
        (topology / "physical_package_id").write_text(f"{package}\n")
        (topology / "core_id").write_text(f"{core}\n")
    return tmp_path


def test_hyper_threads_of_one_core_count_once(tmp_path):
    # 2 packages x 2 cores x 2 threads; a process allowed on 5 of the 8 CPUs
    sys_cpu = fake_topology(tmp_path, {cpu: (cpu // 4, cpu % 2) for cpu in range(8)})
    assert physical_cores(range(8), sys_cpu) == 4
    assert physical_cores([0, 2, 4, 5, 6], sys_cpu) == 3  # 0 and 2 are one core's two threads
    assert physical_cores([3], sys_cpu) == 1


def test_a_cpu_without_topology_counts_as_a_core(tmp_path):
    sys_cpu = fake_topology(tmp_path, {0: (0, 0), 1: (0, 0)})
    assert physical_cores([0, 1, 2, 3], sys_cpu) == 3  # cpu2 and cpu3 have no sysfs entry


def run_tvm(env_extra: dict) -> int:
    """The thread count of TVM's runtime pool in a fresh process after use_physical_cores()."""
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    env.update(env_extra)
    code = ("from appliance.deploy.compiler.runtime import use_physical_cores; use_physical_cores(); "
            "import tvm; print(tvm.runtime.num_threads())")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, cwd=ROOT)
    return int(out.stdout.strip().splitlines()[-1])


def test_the_runtime_pool_gets_the_physical_cores_and_a_users_setting_wins():
    assert run_tvm({}) == physical_cores()
    assert run_tvm({"TVM_NUM_THREADS": "1"}) == 1
    if physical_cores() > 1:
        assert run_tvm({"OMP_NUM_THREADS": "1"}) == 1


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="TVM halves the CPU count on x86_64 only")
def test_without_it_tvm_would_use_half_the_cpus():
    """What the module is for: TVM's own default here (hardware_concurrency / 2)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TVM_NUM_THREADS", "OMP_NUM_THREADS")}
    out = subprocess.run([sys.executable, "-c", "import tvm; print(tvm.runtime.num_threads())"], env=env, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert int(out.stdout.strip().splitlines()[-1]) == max(1, os.cpu_count() // 2)
