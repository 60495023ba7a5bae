"""appliance/deploy/edge/cycles.py, the cycle model for aarch64 builds (benchmarks/arm_cycles.py and
compile.json's device_estimate use it), on tiny real programs (seconds).

The tbcount plugin is built against the installed qemu's qemu-plugin.h and run on an aarch64
program cross-compiled here; llvm-mca 16 costs its blocks. Full models: benchmarks/README.md.
"""

import subprocess

import pytest

from appliance.deploy.edge import cycles

SYSROOT = "/usr/aarch64-linux-gnu"

LOOP_C = r"""
#include <stdlib.h>
#include <unistd.h>
static void mark(void) { lseek(-1, 0x5eed0a11, SEEK_SET); }  /* the plugin snapshots its counters */
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    volatile long acc = 0;
    lseek(-1, 1, SEEK_SET);  /* an lseek that is not the marker: no snapshot */
    mark();
    for (long i = 0; i < n; i++) acc += i * 3;
    mark();
    return (int)(acc & 1);
}
"""


@pytest.fixture(scope="module")
def arm_cycles():
    return cycles


@pytest.fixture(scope="module")
def loop_program(tmp_path_factory):
    d = tmp_path_factory.mktemp("loop")
    (d / "loop.c").write_text(LOOP_C)
    subprocess.run(["aarch64-linux-gnu-gcc", "-O1", str(d / "loop.c"), "-o", str(d / "loop")], check=True)
    return d / "loop"


def test_blocks_between_the_markers_are_counted_exactly(arm_cycles, loop_program, tmp_path):
    counts = {n: arm_cycles.count_blocks([str(loop_program), str(n)], tmp_path, sysroot=SYSROOT)
              for n in (1000, 3000)}
    # the loop body is one block; it ran n times (give or take the entry), and nothing else scales with n
    assert max(counts[1000].values()) in (999, 1000, 1001)
    assert max(counts[3000].values()) - max(counts[1000].values()) == 2000
    assert set(counts[1000]) == set(counts[3000])
    est = {n: arm_cycles.estimate(c, cache=tmp_path / "cache") for n, c in counts.items()}
    for cpu in ("cortex-a76", "cortex-a55"):
        per_iteration = (est[3000][cpu]["cycles"] - est[1000][cpu]["cycles"]) / 2000
        assert 1 <= per_iteration <= 20, (cpu, per_iteration)
        assert est[3000][cpu]["ms"] == pytest.approx(est[3000][cpu]["cycles"] / arm_cycles.CLOCKS_HZ[cpu] * 1e3)
    # the in-order little core is no faster than the out-of-order big one on the same code
    assert est[3000]["cortex-a55"]["cycles"] >= est[3000]["cortex-a76"]["cycles"]
    # costs are cached per unique block: a second estimate reads them back unchanged
    assert arm_cycles.estimate(counts[3000], cache=tmp_path / "cache") == est[3000]


def test_llvm_mca_costs_dependencies_and_cores(arm_cycles):
    independent = [f"add\tx{r}, x{r}, #1" for r in range(1, 9)]
    chain = ["add\tx1, x1, #1"] * 8
    dot = ["sdot\tv0.4s, v1.16b, v2.16b", "sdot\tv3.4s, v1.16b, v2.16b"]
    blocks = {"independent": independent, "chain": chain, "dot": dot, "call": ["bl\t#64"]}
    a76 = arm_cycles.mca_cycles(blocks, "cortex-a76")
    a55 = arm_cycles.mca_cycles(blocks, "cortex-a55")
    assert a76["chain"] == pytest.approx(8, abs=0.2)  # one cycle per dependent add
    # two integer pipes on both models (LLVM 16 costs cortex-a76 with its Cortex-A57 model)
    assert a76["independent"] == pytest.approx(4, abs=0.2)
    assert a55["independent"] >= a76["independent"]
    assert a76["dot"] > 0 and a55["dot"] > 0
    assert a76["call"] < 5  # a call costs its branch, not llvm-mca 16's fixed 100 cycles


def test_disassembly_splits_blocks_back(arm_cycles):
    # add x0, x0, #1 ; ret   and   nop
    blocks = arm_cycles.disassemble(["00040091c0035fd6", "1f2003d5"])
    assert blocks == {"00040091c0035fd6": ["add\tx0, x0, #1", "ret"], "1f2003d5": ["nop"]}


def test_compile_json_carries_the_device_estimate(exported, tmp_path):
    """An aarch64 build's compile.json: estimated cycles and ms at the stated clocks of both cores, from
    one real run of model.so under qemu; the work it counts is the model's, not the Python around it."""
    from appliance.deploy.compiler.driver import compile_model

    info = compile_model(exported / "model.onnx", "aarch64", tmp_path / "arm", device_estimate=True)
    device = info["device_estimate"]
    assert device["estimated"], device
    for cpu, hz in cycles.CLOCKS_HZ.items():
        assert device[cpu]["clock_ghz"] == hz / 1e9
        assert device[cpu]["ms"] == pytest.approx(device[cpu]["cycles"] / hz * 1e3, rel=1e-3)
    # small_cnn at 32 px: about 1 M multiply-adds; a build cannot do that in fewer than ~100 k instructions,
    # and nothing but the model runs between the markers (no interpreter start, no module load)
    assert 1e5 < device["instructions"] < 5e7, device
    assert device["cortex-a55"]["cycles"] >= device["cortex-a76"]["cycles"]
    # onnxruntime on the same model, estimated the same way, and the runtime chosen from the two
    comparison = info["onnxruntime_comparison"]
    assert set(comparison["ratios"]) == set(cycles.CLOCKS_HZ), comparison
    for cpu, ratio in comparison["ratios"].items():
        assert ratio == pytest.approx(device[cpu]["cycles"] / comparison["onnxruntime"][cpu]["cycles"], rel=1e-2)
    mean = (comparison["ratios"]["cortex-a76"] * comparison["ratios"]["cortex-a55"]) ** 0.5
    assert info["runtime"] == ("tvm" if mean <= 1 else "onnxruntime") and info["runtime_requested"] == "auto"
    from appliance.deploy.compiler.runtime_choice import onnxruntime_device_estimate

    kept = onnxruntime_device_estimate(exported / "model.onnx", info["input"]["shape"])
    assert kept["cached"] and kept["cortex-a76"] == comparison["onnxruntime"]["cortex-a76"]  # the model's only: kept
    line = cycles.describe(device)
    assert line.startswith(f"cortex-a76 {device['cortex-a76']['ms']:.2f} ms at 2.4 GHz (") and "cortex-a55" in line
    # where the user looks: edge verify's page and the pipeline summary show the same line
    from appliance.deploy.verify import device_proof_html
    from appliance.pipeline.summary import format_summary

    assert line in device_proof_html({"device_estimate": device})
    summary = {"seconds": 1, "out_dir": str(tmp_path), "accuracy": {}, "sizes_bytes": {}, "artifacts": {},
               "latency_ms": {"host_ort_fp32": 1.0}, "builds": {"aarch64": {"device_estimate": device}}}
    assert f"device estimate aarch64          {line}" in format_summary(summary)


def test_a_missing_tool_is_one_reason_not_a_failure(compiled_arm, monkeypatch):
    monkeypatch.setattr(cycles, "LLVM_MCA", "llvm-mca-missing")
    device = cycles.estimate_build(compiled_arm / "model.so", [1, 3, 32, 32])
    assert device == {"estimated": False, "reason": "llvm-mca-missing: not found (install Debian's llvm-16)"}
    assert cycles.describe(device) == "not estimated: llvm-mca-missing: not found (install Debian's llvm-16)"
    info = __import__("json").loads((compiled_arm / "compile.json").read_text())
    assert info["device_estimate"]["estimated"] is False and "not requested" in info["device_estimate"]["reason"]
