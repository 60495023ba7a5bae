"""The one stage contract (docs/dev/contracts.md, "Stage results"), for every result class: load() of a
directory without its record, or with a damaged one, is one DataError naming the file (no traceback,
no KeyError); figures are flat. The stages' real runs: tests/pipeline/test_rerun.py."""

import pytest

from appliance.core.errors import DataError
from appliance.core.stage import figures_under, flat_figures, is_flat
from appliance.pipeline.plan import CompileResult, ExportResult, GateResult, PackageResult, QuantizeResult, VerifyResult
from appliance.train.result import TrainResult
from data_tools.check.stage import CheckResult

RESULTS = [CheckResult, TrainResult, GateResult, ExportResult, QuantizeResult, CompileResult, PackageResult, VerifyResult]


@pytest.mark.parametrize("result_type", RESULTS, ids=lambda t: t.__name__)
def test_a_missing_or_damaged_record_is_one_data_error_naming_it(tmp_path, result_type):
    with pytest.raises(DataError) as missing:
        result_type.load(tmp_path)
    record = str(missing.value).split(":")[0]
    assert record.startswith(str(tmp_path)) and "missing" in str(missing.value), missing.value
    with open(record, "wb") as f:
        f.write(b'\xff{"target": ')
    with pytest.raises(DataError, match="damaged") as damaged:
        result_type.load(tmp_path)
    assert str(damaged.value).startswith(record)


def test_flat_figures_read_back_as_the_record_held_them():
    record = {"target": "aarch64", "layers": {"int8": 3, "simulated_layers": ["a", "b"]},
              "routes": [{"runner": "native", "top1_agreement": 1.0}], "check": None, "empty": {}}
    figures = flat_figures(record)
    assert is_flat(figures) and not is_flat({"report": record})
    assert figures["layers.int8"] == 3 and figures["routes.0.runner"] == "native"
    assert figures_under(figures, "layers") == record["layers"]
    assert figures_under(figures, "routes") == record["routes"]
    assert figures_under(figures, "check") is None and figures_under(figures, "absent") is None
