"""`appliance data check`: scan every file (in parallel), then the checks that need all of them.

Output directory:
  report.json, report.html   what was found (report.json is the contract: docs/dev/contracts.md)
  schema.json                the schema used (inferred unless --schema was given)
  clean/NAME + NAME.index    per input file: the records that passed every check, in their
                             original order, uncompressed, with a DALI-format index. Train on these.
  quarantine/NAME            per input file: the rejected records' bytes, as TFRecord
  quarantine/reasons.jsonl   per rejected record and check: file, offset, record number, detail;
                             and every unreadable byte range
  manifest.json              inputs with sha256, parameters, outputs
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from appliance.core.errors import ConfigError, DataError
from appliance.core.manifest import atomic_write_text, write_manifest
from data_tools.check import gate as gate_rules
from data_tools.check.balance import label_balance
from data_tools.check.duplicates import copies_to_quarantine, exact_groups, near_groups
from data_tools.check.image_probe import DEFAULT_MAX_PIXELS
from data_tools.check.boxes import add_box_keys, box_range_from_all, detection_report
from data_tools.check.masks import add_mask_keys, mask_range_from_all, segmentation_report
from data_tools.check.mask_overlays import collect_overlays
from data_tools.check.outliers import flag_outliers, outlier_bounds
from data_tools.check.quarantine import move_to_quarantine, write_reasons
from data_tools.check.report_html import write_html
from data_tools.check.report_json import build_report, write_json
from data_tools.check.scan import ScanTask, scan_file, shard_names
from data_tools.check.schema import infer_num_classes, infer_schema, load_schema
from data_tools.check.thumbnails import collect_thumbnails

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
from appliance.core.dirlock import directory_lock
from data_tools.example import decode_example
from data_tools.tfrecord import read_records
from appliance.core.progress import Progress
from data_tools.index import build_index

SCHEMA_SAMPLE = 256  # records read to infer a schema


def run_check(inputs: list[tuple[str, str | None]], out_dir, *, schema_path=None, fail_on: str | None = None,
              image_key="image/encoded", label_key="image/class/label", max_pixels=DEFAULT_MAX_PIXELS,
              near_distance: int = 4, jobs: int | None = None, progress: bool = True,
              command: list[str] | None = None, summary_stream=None, num_classes: int | None = None,
              ignore_label: int = 255, class_names: list[str] | None = None) -> tuple[dict, int]:
    """Check (path, split) inputs, write the output directory; returns (report, exit status).
    The one-line summary goes to summary_stream (default stdout). num_classes: the class labels are
    0..num_classes-1 (classification, as the training config says; segmentation: the masks' class ids,
    records with image/segmentation/class/encoded); None: inferred, and the report says from how many
    records. ignore_label: the masks' ignored pixels; class_names (the config's classes, in id order)
    name the mask classes in the report."""
    conditions = gate_rules.parse_fail_on(fail_on)
    if not 0 <= near_distance <= 7:
        raise ConfigError(f"--near-distance must be 0..7 bits (got {near_distance})")

    # One check per --out directory: two would remove each other's .check-partial mid-run.
    with directory_lock(out_dir, "--out directory"):
        return _run_locked(inputs, Path(out_dir), schema_path=schema_path, fail_on=fail_on, conditions=conditions,
                           image_key=image_key, label_key=label_key, max_pixels=max_pixels,
                           near_distance=near_distance, jobs=jobs, progress=progress, command=command,
                           summary_stream=summary_stream, masks=(num_classes, ignore_label, class_names))


def _run_locked(inputs, out: Path, *, schema_path, fail_on, conditions, image_key, label_key, max_pixels,
                near_distance, jobs, progress, command, summary_stream, masks=(None, 255, None)) -> tuple[dict, int]:
    stage = out / ".check-partial"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "clean").mkdir(parents=True)
    (stage / "quarantine").mkdir()

    paths = [p for p, _ in inputs]
    if schema_path:
        schema, schema_source = load_schema(schema_path), f"given: {schema_path}"
    else:
        schema, schema_source = infer_schema(_schema_sample(paths), image_key, label_key), "inferred"
    schema = add_box_keys(given_label_classes(add_mask_keys(schema, masks[0], masks[1]), masks[0]), masks[0])
    names = shard_names(paths)
    tasks = [ScanTask(i, p, split, names[i], str(stage), schema, max_pixels)
             for i, (p, split) in enumerate(inputs)]
    results = _scan_all(tasks, jobs, progress)

    for result in results:
        if result.error:
            print(f"appliance data check: error: {result.path}: {result.error}", file=sys.stderr)
        elif len(result.offsets) and not result.clean_records and result.reasons:
            check, count = result.checks.most_common(1)[0]
            detail = next(r["detail"] for r in result.reasons if r["check"] == check)
            print(f"appliance data check: error: {result.path}: every record rejected "
                  f"({count} x {check}, e.g. {detail})", file=sys.stderr)

    late = (_label_range_from_all(results, schema) + mask_range_from_all(results, schema)
            + box_range_from_all(results, schema))
    stray = {rid for rid, _, _ in late}
    groups = exact_groups(((r.file_index, n), h) for r in results for n, h, _ in r.hashes()
                          if (r.file_index, n) not in stray)
    late += [(rid, check, f"same image as {results[kept[0]].path} record {kept[1]}")
             for rid, check, kept in copies_to_quarantine(groups, lambda rid: results[rid[0]].split)]
    _quarantine_late(results, names, stage, late)
    near = near_groups([((r.file_index, n), p, h) for r in results for n, h, p in r.hashes()
                        if p is not None and (r.file_index, n) not in stray], max_distance=near_distance)

    statistics, outliers = _statistics(results)
    _build_indexes(stage, results, names)
    write_reasons(stage / "quarantine" / "reasons.jsonl", results, names)
    labels = _labels(results, schema)
    report = build_report(
        results=results, names=names, schema=schema, schema_source=schema_source, labels=labels,
        statistics=statistics, outliers=outliers, exact=groups, near=near,
        params={"image_key": image_key, "label_key": label_key, "max_pixels": max_pixels,
                "near_distance": near_distance, "fail_on": fail_on}, command=command)
    gate_metrics = dict(report["metrics"])
    if gate_metrics["imbalance"] is None:  # an empty class cannot be learnt; no labels: nothing to balance
        gate_metrics["imbalance"] = float("inf") if labels["empty_classes"] else 1.0
    report["gate"] = gate_rules.evaluate(conditions, gate_metrics)
    segmentation = _add_task_reports(report, results, schema, masks)

    _publish(stage, out)
    thumbs = collect_thumbnails(out, report, results, names)
    if segmentation:
        thumbs["overlays"] = collect_overlays(out, report, results, names)
    write_json(out / REPORT_JSON, report)
    atomic_write_text(out / "schema.json", json.dumps(schema, indent=2) + "\n")
    write_html(out / REPORT_HTML, report, thumbs)
    write_manifest(out, "check", [p for p, r in zip(paths, results) if not r.error],
                   params=report["params"])

    print(f"checked {report['records_total']} records in {len(paths)} files: "
          f"{report['records_valid']} valid, {report['records_quarantined']} quarantined, "
          f"{len(report['damaged_ranges'])} unreadable byte ranges; report: {out / REPORT_HTML}",
          file=summary_stream or sys.stdout)
    if str(report["labels"].get("num_classes_source", "")).startswith("inferred"):
        print(f"classes: {report['labels']['num_classes']}, {report['labels']['num_classes_source']} "
              "(give --num-classes, or num_classes in --schema, to check labels against the config's)",
              file=summary_stream or sys.stdout)
    for line in report["gate"]["failed"]:
        print(f"gate failed: {line}", file=sys.stderr)
    if not report["gate"]["passed"]:
        return report, 3
    return report, 2 if any(r.error for r in results) else 0


def _add_task_reports(report: dict, results, schema: dict, masks) -> dict | None:
    """The masks' and the boxes' sections of the report (when the records have them); returns the masks'."""
    segmentation = segmentation_report(results, schema)
    if segmentation:
        if masks[2]:
            segmentation["class_names"] = {str(c): str(n) for c, n in enumerate(masks[2][:segmentation["num_classes"]])}
        report["segmentation"] = segmentation
        report["params"].update(num_classes=masks[0], ignore_label=masks[1])
    detection = detection_report(results, schema)
    if detection:
        report["detection"] = detection
        report["params"].update(num_classes=masks[0])
    return segmentation


def _schema_sample(paths: list[str]) -> list[dict]:
    sample = []
    for path in paths:
        try:
            for data in read_records(path):
                try:
                    sample.append(decode_example(bytes(data)))
                except DataError:
                    continue
                if len(sample) >= SCHEMA_SAMPLE:
                    return sample
        except (DataError, OSError):
            continue  # reported by the scan
    return sample


_queue = None


def _set_queue(queue) -> None:
    global _queue
    _queue = queue


def _scan_in_worker(task: ScanTask):
    task.progress = _queue
    return scan_file(task)


def _scan_all(tasks: list[ScanTask], jobs: int | None, show_progress: bool) -> list:
    """Scan files, in a process pool when there are several files and cores; a live progress bar."""
    total = sum(os.path.getsize(t.path) for t in tasks if os.path.isfile(t.path))
    bar = Progress(total=total, unit="B", unit_scale=True, desc="data check", enabled=show_progress)
    records = 0
    jobs = min(jobs or len(os.sched_getaffinity(0)), len(tasks))  # a process per file at most: more have nothing to do
    context = multiprocessing.get_context("fork")
    queue = context.SimpleQueue()

    def drain():
        nonlocal records
        while not queue.empty():
            n, b = queue.get()
            records += n
            bar.update(b)
        bar.set_postfix(f"{records} records")

    results = [None] * len(tasks)
    if jobs <= 1:
        direct = _DirectProgress(bar)
        for task in tasks:
            task.progress = direct
            results[task.file_index] = scan_file(task)
    else:
        with cf.ProcessPoolExecutor(jobs, mp_context=context, initializer=_set_queue,
                                    initargs=(queue,)) as pool:
            pending = {pool.submit(_scan_in_worker, t): t.file_index for t in tasks}
            while pending:
                done, _ = cf.wait(pending, timeout=0.2)
                drain()
                for future in done:
                    results[pending.pop(future)] = future.result()
            time.sleep(0.05)
            drain()
    bar.close()
    return results


class _DirectProgress:
    """In-process stand-in for the queue (a pipe would fill up with nobody reading it)."""

    def __init__(self, bar):
        self.bar, self.records = bar, 0

    def put(self, item) -> None:
        self.records += item[0]
        self.bar.update(item[1])
        self.bar.set_postfix(f"{self.records} records")


def given_label_classes(schema: dict, num_classes: int | None) -> dict:
    """--num-classes (the training config's classes) on a classification schema: labels outside
    0..num_classes-1 are quarantined during the scan (label_range), as training refuses them."""
    spec = schema["features"].get(schema.get("label_key") or "")
    if num_classes is None or schema.get("mask_key") or spec is None:
        return schema
    schema["num_classes"] = int(num_classes)
    schema["num_classes_source"] = "given by --num-classes"
    if spec.get("dtype") == "int64":
        spec.update(min=0, max=int(num_classes) - 1)
    return schema


def _label_range_from_all(results, schema) -> list[tuple]:
    """With an inferred schema the label range comes from every record; the strays are rejected."""
    spec = schema["features"].get(schema.get("label_key") or "")
    if spec is None or "max" in spec or spec["dtype"] != "int64":
        return []  # a given range was checked during the scan
    histogram = Counter(label for r in results for label in r.labels.values)
    k = infer_num_classes(histogram)
    if k is None:
        return []
    schema["num_classes"] = k
    schema["num_classes_source"] = f"inferred from the labels of {sum(histogram.values())} records"
    spec.update(min=0, max=k - 1)
    return [((r.file_index, n), "label_range", f"{schema['label_key']} = {label} outside 0..{k - 1}")
            for r in results for n, label in r.labels if not 0 <= label < k]


def _quarantine_late(results, names, stage: Path, rejected) -> None:
    """Move records rejected after the scan (label range, duplicates, leakage) into the quarantine."""
    by_file: dict[int, set] = {}
    for (file_index, number), check, detail in rejected:
        result = results[file_index]
        result.reasons.append({"record_number": number, "check": check, "detail": detail})
        result.checks[check] += 1
        by_file.setdefault(file_index, set()).add(number)
    for file_index, numbers in by_file.items():
        move_to_quarantine(results[file_index], stage, names[file_index], numbers)


def _statistics(results) -> tuple[dict, list]:
    import numpy as np

    names = sorted({name for r in results for name in r.stats})
    statistics, outliers = {}, []
    for name in names:
        columns = [(r.file_index, r.stats[name]) for r in results if name in r.stats]
        files = np.concatenate([np.full(len(c), f, dtype=np.int64) for f, c in columns])
        numbers = np.concatenate([np.frombuffer(c.numbers, dtype=np.int64) for _, c in columns])
        values = np.concatenate([np.frombuffer(c.values, dtype=np.float64) for _, c in columns])
        bounds = outlier_bounds(values)
        # A histogram per statistic (30 bins) for the HTML report, computed here so the
        # report never needs the raw values again.
        if values.size:
            counts, edges = np.histogram(values, bins=30)
            bounds["histogram"] = {"counts": counts.tolist(), "edges": edges.tolist()}
        statistics[name] = bounds
        for pos, rules in flag_outliers(values, bounds):
            file_index, number = int(files[pos]), int(numbers[pos])
            result = results[file_index]
            outliers.append({"file": result.path, "record_number": number,
                             "offset": result.offset(number), "statistic": name,
                             "value": float(values[pos]), "rules": rules})
    return statistics, outliers


def _labels(results, schema) -> dict:
    overall, by_split = Counter(), {}
    for r in results:
        clean = set(r.clean_records)
        counts = Counter(label for n, label in r.labels if n in clean)
        overall.update(counts)
        if r.split:
            by_split.setdefault(r.split, Counter()).update(counts)
    balance = label_balance(overall, schema.get("num_classes"))
    names: dict[int, str] = {}
    for r in results:
        for label, name in r.class_names.items():
            if label in overall:  # not a stray label quarantined after the scan
                names.setdefault(label, name)
    balance["class_names"] = {str(k): v for k, v in sorted(names.items())}
    if schema.get("num_classes") and schema.get("label_key") and not schema.get("mask_key"):
        balance["num_classes"] = int(schema["num_classes"])
        balance["num_classes_source"] = schema.get("num_classes_source", "given by the schema")
    balance["by_split"] = {s: label_balance(c, schema.get("num_classes")) for s, c in by_split.items()}
    return balance


def _build_indexes(stage: Path, results, names) -> None:
    for result, name in zip(results, names):
        if result.clean_records:
            build_index(stage / "clean" / name)


def _publish(stage: Path, out: Path) -> None:
    # The previous check's clean/ and quarantine/ stay until this one is complete.
    for sub in ("clean", "quarantine"):
        old = out / f".{sub}-old"
        shutil.rmtree(old, ignore_errors=True)
        if (out / sub).exists():
            os.replace(out / sub, old)
        os.replace(stage / sub, out / sub)
        shutil.rmtree(old, ignore_errors=True)
    shutil.rmtree(stage, ignore_errors=True)
