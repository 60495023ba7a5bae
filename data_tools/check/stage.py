"""The data check as a pipeline stage: typed inputs in, a typed result out, the gate as GateFailed."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import DataError, GateFailed
from data_tools.check.run import run_check

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


@dataclass(frozen=True)
class CheckResult:
    out_dir: Path
    report_json: Path
    report_html: Path
    clean: dict[str, tuple[Path, ...]]  # split ("train", "val") -> its clean, indexed shards
    records_total: int
    records_valid: int
    records_quarantined: int

    @classmethod
    def load(cls, out_dir: Path) -> "CheckResult":
        """The result of a finished check in out_dir, from its report.json."""
        path = Path(out_dir) / REPORT_JSON
        try:
            report = json.loads(path.read_text())
        except FileNotFoundError:
            raise DataError(f"{path}: missing (is {out_dir} the output of `appliance data check`?)") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise DataError(f"{path}: damaged ({err}); run the check again") from None
        return result_of(Path(out_dir), report)

    def figures(self) -> dict:
        return {"records_total": self.records_total, "records_valid": self.records_valid,
                "records_quarantined": self.records_quarantined, "report": str(self.report_html)}


class CheckFailed(GateFailed):
    """The check's gate failed (exit status 3) or an input file could not be read (2). The per-file and
    `gate failed:` lines are printed already (run_check); the message names the report."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def check_stage(files, out_dir: Path, *, fail_on: str | None = None, on_report=None, **options) -> CheckResult:
    """`appliance data check` and the pipeline's check stage: check (file, split) pairs (split None,
    "train" or "val") into out_dir. on_report(report) is called before the gate (the CLI prints it);
    CheckFailed (exit 3) when the gate fails, (exit 2) when a file cannot be read at all.
    options: those of run_check (schema_path, image_key, label_key, progress, ...)."""
    report, status = run_check([(str(p), split) for p, split in files], out_dir, fail_on=fail_on, **options)
    out_dir = Path(out_dir)
    if on_report is not None:
        on_report(report)
    if status != 0:
        failed = "; ".join(report.get("gate", {}).get("failed", [])) or "a file could not be read"
        raise CheckFailed(f"{out_dir / REPORT_JSON}: data check gate failed: {failed}", status)
    return result_of(out_dir, report)


def result_of(out_dir: Path, report: dict) -> CheckResult:
    clean: dict[str, list[Path]] = {}
    for f in report["files"]:
        if f.get("clean_shard"):
            clean.setdefault(f.get("split") or "", []).append(out_dir / f["clean_shard"])
    return CheckResult(out_dir=out_dir, report_json=out_dir / REPORT_JSON, report_html=out_dir / REPORT_HTML,
                       clean={k: tuple(v) for k, v in clean.items()}, records_total=report["records_total"],
                       records_valid=report["records_valid"], records_quarantined=report["records_quarantined"])
