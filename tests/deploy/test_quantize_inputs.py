"""Quantize's inputs refused in one line: calibration tensors holding NaN or inf (onnxruntime's
calibration asserted "scale issue"), and `--qat` naming no directory (an empty value was ignored,
a file or a device an internal NotADirectoryError)."""

import numpy as np
import pytest

from appliance.cli import build_parser
from appliance.core.errors import DataError
from appliance.deploy.samples import load_samples


@pytest.mark.parametrize("poison", [np.nan, np.inf, 1e300])
def test_calibration_tensors_must_be_finite(tmp_path, poison):
    x = np.zeros((4, 3, 8, 8), dtype=np.float64)
    x[2, 1, 3, 4] = poison
    np.savez(tmp_path / "calib.npz", x=x)
    with pytest.raises(DataError) as err:
        load_samples([tmp_path / "calib.npz"], {})
    assert str(err.value) == (f"{tmp_path / 'calib.npz'}: 'x' holds 1 values that are NaN or infinite (the first at "
                              "sample 2, index (1, 3, 4)); tensors must be finite")


def test_calibration_tensors_of_text_are_refused(tmp_path):
    np.save(tmp_path / "calib.npy", np.full((2, 1, 2, 2), "a"))
    with pytest.raises(DataError, match="holds <U1 values, not numbers"):
        load_samples([tmp_path / "calib.npy"], {})


@pytest.mark.parametrize("value,expected", [("", "must name a directory, got an empty value"),
                                            ("/dev/null", "/dev/null is a device, pipe or socket, not a directory"),
                                            ("FILE", "is a file, not a directory"),
                                            ("MISSING", "no such directory")])
def test_qat_names_a_run_directory(tmp_path, capsys, value, expected):
    (tmp_path / "model.onnx").write_bytes(b"")
    value = {"FILE": str(tmp_path / "model.onnx"), "MISSING": str(tmp_path / "nope")}.get(value, value)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["quantize", str(tmp_path / "model.onnx"), "--calib", "c.npz", "--out",
                                   str(tmp_path / "q"), "--qat", value])
    err = capsys.readouterr().err
    assert "argument --qat: " in err and expected in err and len(err.strip().splitlines()) == 1, err
