"""The data check as a pipeline stage: typed inputs in, a typed result out, the gate as GateFailed."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.errors import DataError, GateFailed
from appliance.core.stage import Figures, read_result_json
from data_tools.check.run import REPORT_HTML, REPORT_JSON, run_check


@dataclass(frozen=True)
class CheckResult:
    out_dir: Path
    report_json: Path
    report_html: Path
    clean: dict[str, tuple[Path, ...]]  # split ("train", "val") -> its clean, indexed shards
    records_total: int
    records_valid: int
    records_quarantined: int
    report: dict = field(default_factory=dict, repr=False, compare=False)  # report.json's content

    @classmethod
    def load(cls, out_dir: Path) -> "CheckResult":
        """The result of a finished check in out_dir, from its report.json."""
        return result_of(Path(out_dir), read_result_json(Path(out_dir) / REPORT_JSON))

    def figures(self) -> Figures:
        return {"records_total": self.records_total, "records_valid": self.records_valid,
                "records_quarantined": self.records_quarantined, "report": str(self.report_html)}


def check_stage(files, out_dir: Path, *, fail_on: str | None = None, on_result=None, **options) -> CheckResult:
    """`appliance data check` and the pipeline's check stage: check (file, split) pairs (split None,
    "train" or "val") into out_dir. on_result(result) is called before the gate (the CLI prints it);
    GateFailed (exit 3) when the gate fails, DataError (exit 2) when a file cannot be read at all; the
    per-file and `gate failed:` lines are printed already (run_check). options: those of run_check
    (schema_path, image_key, label_key, progress, ...)."""
    report, status = run_check([(str(p), split) for p, split in files], out_dir, fail_on=fail_on, **options)
    out_dir = Path(out_dir)
    result = result_of(out_dir, report)
    if on_result is not None:
        on_result(result)
    failed = "; ".join(report.get("gate", {}).get("failed", [])) or "a file could not be read"
    if status == GateFailed.exit_code:
        raise GateFailed(f"{out_dir / REPORT_JSON}: data check gate failed: {failed}")
    if status != 0:
        raise DataError(f"{out_dir / REPORT_JSON}: data check gate failed: {failed}")
    return result


def result_of(out_dir: Path, report: dict) -> CheckResult:
    clean: dict[str, list[Path]] = {}
    for f in report["files"]:
        if f.get("clean_shard"):
            clean.setdefault(f.get("split") or "", []).append(out_dir / f["clean_shard"])
    return CheckResult(out_dir=out_dir, report_json=out_dir / REPORT_JSON, report_html=out_dir / REPORT_HTML,
                       clean={k: tuple(v) for k, v in clean.items()}, records_total=report["records_total"],
                       records_valid=report["records_valid"], records_quarantined=report["records_quarantined"],
                       report=report)
