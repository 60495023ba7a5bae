"""`appliance edge estimate` refuses what it cannot build in one line, before any path or array is made
from it (issue 43): architecture names outside the offered list (a path such as
`../campaign4/c7/TRAVPROBE` made a folder outside the estimate's temporary directory), an empty list
(an empty table, exit 0), sizes and class counts past their stated bounds (internal errors, a 27.9 GiB
and a 512 GB allocation)."""

import os

import pytest

from conftest import one_line, run_appliance
from appliance.core.errors import ConfigError
from appliance.deploy import options

BAD = [
    (["--architectures", "../campaign4/c7/TRAVPROBE"], "--architectures: '../campaign4/c7/TRAVPROBE' is not an "
     "architecture the estimate builds; choose from small_cnn, resnet18"),
    (["--architectures", "../../etc/passwd"], "'../../etc/passwd' is not an architecture the estimate builds"),
    (["--architectures", "onnx"], "'onnx' is not an architecture the estimate builds"),
    (["--architectures", "/tmp/x,small_cnn"], "'/tmp/x' is not an architecture the estimate builds"),
    (["--architectures", ""], "--architectures: names no architecture; choose from small_cnn"),
    (["--architectures", ",,"], "--architectures: names no architecture"),
    (["--architectures", "small_cnn,small_cnn"], "--architectures: small_cnn named more than once"),
    (["--architectures", "small_cnn", "--size", "1"], "--size: must be at least 16, got 1"),
    (["--architectures", "small_cnn", "--size", "100000"], "--size: must be at most 1024, got 100000"),
    (["--architectures", "small_cnn", "--size", str(2**63 - 1)], f"--size: must be at most 1024, got {2**63 - 1}"),
    (["--architectures", "small_cnn", "--size", "2^63-1"], "--size: must be a size in pixels, got '2^63-1'"),
    (["--architectures", "small_cnn", "--classes", str(10**9)], "--classes: must be at most 100000, got 1000000000"),
    (["--architectures", "small_cnn", "--classes", "0"], "--classes: must be at least 1, got 0"),
]


def test_bad_requests_are_one_line_each_and_nothing_is_made(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    work = tmp_path / "cwd" / "a" / "b"
    work.mkdir(parents=True)
    env = {**os.environ, "TMPDIR": str(scratch)}
    for args, expected in BAD:
        proc = run_appliance("edge", "estimate", *args, "--out", str(work / "out"), env=env, cwd=work)
        line = one_line(proc, 2)
        assert line.startswith("appliance edge estimate: error: argument ") and expected in line, (args, line)
    made = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    assert made == ["cwd", "cwd/a", "cwd/a/b", "tmp"], made  # no TRAVPROBE, no out/, no temporary folder


@pytest.mark.parametrize("archs, size, classes, expected", [
    (["../campaign4/c7/TRAVPROBE"], 16, 2, "--architectures: '../campaign4/c7/TRAVPROBE' is not an architecture"),
    ([], 16, 2, "--architectures: names no architecture"),
    (["small_cnn"], 100_000, 2, "--size must be at most 1024, got 100000"),
    (["small_cnn"], 16, 10**9, "--classes must be at most 100000, got 1000000000"),
])
def test_the_library_function_checks_before_it_builds(tmp_path, monkeypatch, archs, size, classes, expected):
    """The pipeline and Python callers reach estimate_architectures without the command line's checks."""
    from appliance.deploy.estimate import estimate_architectures

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(ConfigError) as err:
        estimate_architectures(archs, "aarch64", size, tmp_path / "out", classes=classes, log=lambda line: None)
    assert expected in str(err.value)
    assert not list(tmp_path.iterdir())


def test_the_pipeline_names_its_keys():
    problem = options.estimate_problem(["small_cnn"], 2048, 2, names=("[model] architecture", "[data] image_size",
                                                                      "[model] num_classes"))
    assert problem == "[data] image_size must be at most 1024, got 2048"
