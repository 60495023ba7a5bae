"""Pipeline config validation: one line naming the file and the key."""

import pytest

from appliance.core.errors import ConfigError
from appliance.pipeline.config import load_pipeline_config
from appliance.pipeline.runner import fingerprint

BASE = """
[data]
train = ["t.tfrecord"]
val = ["v.tfrecord"]
classes = ["a", "b"]
"""


def write(tmp_path, text):
    for name in ("t.tfrecord", "v.tfrecord"):
        (tmp_path / name).write_bytes(b"")
    path = tmp_path / "pipeline.toml"
    path.write_text(text)
    return path


def test_defaults_and_output_dir(tmp_path):
    cfg = load_pipeline_config(write(tmp_path, BASE))
    assert cfg.quantize.mode == "int8" and cfg.compile.targets == ("x86_64", "aarch64")
    assert cfg.quantize.fallback == "auto" and cfg.quantize.max_float_layers == 10
    assert cfg.compile.runtime == "auto"  # the package runs the faster of TVM and onnxruntime
    assert cfg.out_dir == (tmp_path / "pipeline-out").resolve()


@pytest.mark.parametrize("extra, message", [
    ("[quantize]\nmod = 'int8'\n", "[quantize] unknown key 'mod'"),
    ("[quantize]\nmax_drop = 'one'\n", "[quantize] max_drop must be a number"),
    ("[quantize]\nfallback = 'always'\n", "[quantize] fallback must be auto or none, got 'always'"),
    ("[compile]\ntargets = ['riscv']\n", "unknown target 'riscv'"),
    ("[compile]\nruntime = 'ort'\n", "[compile] runtime must be one of auto, tvm, onnxruntime, got 'ort'"),
    ("[package]\ntarget = 'aarch64'\n[compile]\ntargets = ['x86_64']\n", "is not among [compile] targets"),
    ("[package]\ntarget = 'x86_64-openvino'\n[compile]\ntargets = ['x86_64']\n", "is not among [compile] targets"),
    ("[package]\ntarget = 'x86_64'\n", "[package] target must be aarch64 or x86_64-openvino, got 'x86_64'"),
    ("[deploi]\nx = 1\n", "unknown section [deploi]"),
    # The training sections are checked as a training config when the pipeline config loads.
    ("[optimizer]\nlrr = 0.1\n", "[optimizer] unknown key 'lrr'"),
    ("[model]\narchitecture = 'resnet1800'\n", "[model] architecture 'resnet1800' is not one of"),
    ("[train]\nbatch_size = 0\n", "[train] batch_size must be at least 1"),
])
def test_mistakes_name_the_file_and_key(tmp_path, extra, message):
    path = write(tmp_path, BASE + extra)
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(path)
    assert str(path) in str(err.value) and message in str(err.value)


def test_the_openvino_route_is_a_compile_and_package_target(tmp_path):
    cfg = load_pipeline_config(write(tmp_path, BASE + "[compile]\ntargets = ['openvino']\n"
                                     "[package]\ntarget = 'x86_64-openvino'\n"))
    assert cfg.compile.targets == ("openvino",) and cfg.package.target == "x86_64-openvino"


def test_training_files_are_resolved_at_load(tmp_path):
    cfg = load_pipeline_config(write(tmp_path, BASE))
    assert cfg.train_files == ((tmp_path / "t.tfrecord").resolve(),)
    path = write(tmp_path, BASE.replace("t.tfrecord", "missing-*.tfrecord"))
    with pytest.raises(ConfigError, match=r"\[data\] train: 'missing-\*.tfrecord' matches no file"):
        load_pipeline_config(path)


def test_missing_training_data_is_named(tmp_path):
    path = write(tmp_path, "[check]\nenabled = false\n")
    with pytest.raises(ConfigError, match=r"\[data\] train"):
        load_pipeline_config(path)


def test_fingerprint_follows_params_and_input_hashes():
    base = fingerprint({"lr": 0.1}, ["a", "b"])
    assert base == fingerprint({"lr": 0.1}, ["a", "b"])
    assert base != fingerprint({"lr": 0.2}, ["a", "b"])
    assert base != fingerprint({"lr": 0.1}, ["a", "c"])


@pytest.mark.parametrize("extra, message", [
    ("[verify]\nmin_agreement = nan\n", "[verify] min_agreement must be a finite number, got nan"),
    ("[verify]\nmin_agreement = 1.5\n", "[verify] min_agreement must be at most 1, got 1.5"),
    ("[quantize]\nmax_drop = nan\n", "[quantize] max_drop must be a finite number, got nan"),
    ("[quantize]\ncalib_samples = -4\n", "[quantize] calib_samples must be at least 1, got -4"),
    ("[quantize]\nmax_float_layers = -1\n", "[quantize] max_float_layers must be at least 0, got -1"),
    ("[export]\nmax_rel_error = -1e-5\n", "[export] max_rel_error must be at least 0, got -1e-05"),
    ("[pipeline]\nmax_restarts = -3\n", "[pipeline] max_restarts must be at least 0, got -3"),
    ("[optimizer]\nlr = inf\n", "[optimizer] lr must be a finite number, got inf"),
    ("[train]\nepochs = -1\n", "[train] epochs must be at least 0, got -1"),
    ("[check]\nfail_on = 'corupt>0'\n", "[check] fail_on: unknown metric 'corupt'"),
    ("[check]\nfail_on = 'corrupt>1.2.3'\n", "[check] fail_on: 'corrupt>1.2.3' is not METRIC>NUMBER"),
])
def test_numbers_and_gates_are_checked_at_load_naming_the_config_key(tmp_path, extra, message):
    path = write(tmp_path, BASE + extra)
    with pytest.raises(ConfigError) as err:
        load_pipeline_config(path)
    assert str(err.value).startswith(f"{path.resolve()}: {message}"), str(err.value)
    assert "--fail-on" not in str(err.value)


def test_the_quantize_engine_is_a_stage_parameter_only_when_it_is_not_the_default(tmp_path):
    """A run quantized before `[quantize] engine` existed keeps its fingerprint; nncf reruns quantize."""
    from appliance.pipeline.plan import plan

    def quantize_params(extra):
        return next(s for s in plan(load_pipeline_config(write(tmp_path, BASE + extra))) if s.name == "quantize").params

    assert "engine" not in quantize_params("")
    assert quantize_params("[quantize]\nengine = 'nncf'\n")["engine"] == "nncf"
    with pytest.raises(ConfigError, match=r"\[quantize\] engine must be ours or nncf, got 'onnx'"):
        load_pipeline_config(write(tmp_path, BASE + "[quantize]\nengine = 'onnx'\n"))
