"""Pipeline config validation: one line naming the file and the key."""

import pytest

from appliance.errors import ConfigError
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
    assert cfg.out_dir == (tmp_path / "pipeline-out").resolve()


@pytest.mark.parametrize("extra, message", [
    ("[quantize]\nmod = 'int8'\n", "[quantize] unknown key 'mod'"),
    ("[quantize]\nmax_drop = 'one'\n", "[quantize] max_drop must be a number"),
    ("[compile]\ntargets = ['riscv']\n", "unknown target 'riscv'"),
    ("[package]\ntarget = 'aarch64'\n[compile]\ntargets = ['x86_64']\n", "is not among [compile] targets"),
    ("[deploy]\nx = 1\n", "unknown section [deploy]"),
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
