"""Know before you train: `appliance edge estimate` builds untrained architectures and estimates their
device latency, and `[deploy] latency_budget_ms` stops a pipeline whose model cannot meet it before
any training. Real exports, TVM aarch64 builds, qemu runs and llvm-mca costs, on small_cnn at 16 px."""

import json

from conftest import run_appliance

CONFIG = """
[data]
train = ["t.tfrecord"]
val = ["v.tfrecord"]
classes = ["a", "b"]
image_size = 16

[model]
architecture = "small_cnn"

[compile]
targets = ["aarch64"]

[package]
target = "aarch64"

[deploy]
latency_budget_ms = {budget}
"""


def test_edge_estimate_table_and_a_budget_below_it_stops_the_pipeline_before_training(tmp_path):
    """One real estimate (two compiles, two qemu runs) serves both: `appliance edge estimate --out`
    writes it where the pipeline keeps its own, and the pipeline reuses it for the same model."""
    out = tmp_path / "pipeline-out"
    proc = run_appliance("edge", "estimate", "--architectures", "small_cnn", "--target", "aarch64", "--size", "16",
                         "--classes", "2", "--out", str(out / "estimate"))
    assert proc.returncode == 0, proc.stderr
    table = json.loads((out / "estimate" / "estimate.json").read_text())
    (row,) = table["rows"]
    assert row["architecture"] == "small_cnn" and row["parameters"] > 1000 and table["size"] == 16
    for precision in ("fp32", "int8"):
        device = row[precision]["device_estimate"]
        assert device["estimated"], device
        assert 0 < device["cortex-a76"]["ms"] <= device["cortex-a55"]["ms"] * 2
        # onnxruntime on the same model beside ours, and the runtime a package of it would use
        peer = row[precision]["onnxruntime"]
        assert peer["estimated"] and peer["cortex-a76"]["ms"] > 0 and peer["cortex-a55"]["ms"] > 0, peer
        faster = device["cortex-a76"]["ms"] * device["cortex-a55"]["ms"] <= peer["cortex-a76"]["ms"] * peer["cortex-a55"]["ms"]
        assert row[precision]["runtime"] == ("tvm" if faster else "onnxruntime"), row[precision]["runtime_reason"]
    # int8 layers are counted as on our kernels or generic ones; FP32 has none
    assert row["int8"]["int8_layers"] == row["int8"]["int8_on_our_kernels"] + row["int8"]["int8_generic"] > 0
    assert row["fp32"]["int8_layers"] == 0
    assert "| small_cnn |" in proc.stdout and "TVM INT8 cortex-a76 ms (2.4 GHz)" in proc.stdout
    assert "ORT INT8 cortex-a55 ms (1.8 GHz)" in proc.stdout and "package runs FP32 / INT8" in proc.stdout
    assert "<svg" in (out / "estimate" / "estimate.html").read_text()

    for name in ("t.tfrecord", "v.tfrecord"):
        (tmp_path / name).write_bytes(b"")
    config = tmp_path / "pipeline.toml"
    config.write_text(CONFIG.format(budget=0.0001))
    proc = run_appliance("pipeline", str(config))
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    int8_ms = row["int8"]["device_estimate"]["cortex-a76"]["ms"]
    assert (f"[deploy] latency_budget_ms 0.0001: small_cnn int8 at 16 px is estimated at {int8_ms:.2f} ms on "
            "cortex-a76 (2.4 GHz), over the budget; nothing was trained") in lines[0]
    assert "latency budget: the estimate kept in" in proc.stderr and "estimating" not in proc.stderr
    assert not (out / "train").exists() and not (out / "check").exists()
    # a budget the estimate meets lets the run go on to its stages
    config.write_text(CONFIG.format(budget=1e6))
    proc = run_appliance("pipeline", str(config))
    assert f"latency budget 1e+06 ms on cortex-a76: estimated {int8_ms:.2f} ms" in proc.stderr
    # another size is another model: estimated again, in the pipeline, before training
    config.write_text(CONFIG.format(budget=0.0001).replace("image_size = 16", "image_size = 32"))
    proc = run_appliance("pipeline", str(config))
    assert "latency budget: estimating small_cnn at 32 px for aarch64 before training" in proc.stderr
    assert "small_cnn int8 at 32 px is estimated at" in proc.stderr and not (out / "train").exists()
