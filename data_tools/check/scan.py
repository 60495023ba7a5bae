"""One pass over one input file: framing, parse, schema, image; clean and quarantined records split.

Runs in a worker process (one file per task). It streams: each record is checked, written to
the clean shard or the quarantine shard, and only a small summary (numbers, two hashes, a few
statistics) is kept, so memory grows by tens of bytes per record, never by images.
"""

from __future__ import annotations

import dataclasses
from array import array
import os
import stat
import time
from collections import Counter
from pathlib import Path

from appliance.core.errors import DataError
from appliance.core.inputs import describe
from data_tools.check.image_probe import ImageProblem, content_hash, probe_image
from data_tools.check.boxes import box_notes, box_summary
from data_tools.check.masks import empty_mask_note, mask_summary
from data_tools.check.schema import schema_num_classes, validate
from data_tools.example import decode_example
from data_tools.labels import image_problem, label_problem
from data_tools.tfrecord import TFRecordWriter, detect_compression, iter_records_with_offsets

IMAGE_STATS = ("brightness", "contrast", "width", "height", "aspect", "encoded_size")


@dataclasses.dataclass
class ScanTask:
    file_index: int
    path: str
    split: str | None  # "train", "val" or None
    shard_name: str  # name of this file's clean and quarantine shards
    out_dir: str
    schema: dict
    max_pixels: int
    progress: object = None  # a queue taking (records, bytes) increments


class Column:
    """(record number, value) pairs in two flat arrays: 16 bytes a pair instead of ~100 as tuples."""

    __slots__ = ("numbers", "values")

    def __init__(self, typecode: str = "d"):
        self.numbers, self.values = array("q"), array(typecode)

    def append(self, number: int, value) -> None:
        self.numbers.append(number)
        self.values.append(value)

    def __len__(self) -> int:
        return len(self.numbers)

    def __iter__(self):
        return zip(self.numbers, self.values)


@dataclasses.dataclass
class FileResult:
    """What one file held; positions in clean_records / quarantined_records are shard positions.

    Per record it keeps only numbers in flat arrays (offset, label, 16-byte content hash,
    perceptual hash, six statistics): about 150 bytes, so a million records fit in ~150 MB.
    """

    file_index: int
    path: str
    split: str | None
    compression: str | None = None
    bytes: int = 0
    error: str | None = None  # the file could not be read at all
    # dicts: start, end, record_number, reason (+ compressed_start, compressed_end for stream damage)
    damaged: list = dataclasses.field(default_factory=list)
    offsets: array = dataclasses.field(default_factory=lambda: array("q"))  # [record number] -> byte offset
    clean_records: array = dataclasses.field(default_factory=lambda: array("q"))  # record numbers, shard order
    quarantined_records: array = dataclasses.field(default_factory=lambda: array("q"))
    reasons: list = dataclasses.field(default_factory=list)  # dicts: record_number, check, detail
    checks: Counter = dataclasses.field(default_factory=Counter)  # check -> records it flagged
    labels: Column = dataclasses.field(default_factory=lambda: Column("q"))  # of records that passed the scan
    hash_numbers: array = dataclasses.field(default_factory=lambda: array("q"))
    content_hashes: bytearray = dataclasses.field(default_factory=bytearray)  # 16 bytes per hash_numbers entry
    perceptual_hashes: array = dataclasses.field(default_factory=lambda: array("Q"))
    has_perceptual_hash: bytearray = dataclasses.field(default_factory=bytearray)
    stats: dict = dataclasses.field(default_factory=dict)  # statistic -> Column
    notes: list = dataclasses.field(default_factory=list)  # reported, not quarantined: (record, check, detail)
    class_names: dict = dataclasses.field(default_factory=dict)  # label -> first image/class/text seen
    masks: dict = dataclasses.field(default_factory=dict)  # segmentation: record -> {"classes", "pixels"}
    boxes: dict = dataclasses.field(default_factory=dict)  # detection: record -> {"labels", "tiny", ...}

    def offset(self, number: int) -> int | None:
        return self.offsets[number] if 0 <= number < len(self.offsets) and self.offsets[number] >= 0 else None

    def hashes(self):
        """(record number, content hash, perceptual hash or None) of every record that passed the scan."""
        for i, number in enumerate(self.hash_numbers):
            digest = bytes(self.content_hashes[16 * i:16 * i + 16])
            yield number, digest, self.perceptual_hashes[i] if self.has_perceptual_hash[i] else None


def scan_file(task: ScanTask) -> FileResult:
    result = FileResult(task.file_index, task.path, task.split)
    path = Path(task.path)
    try:
        info = path.stat()
        result.bytes = info.st_size
        if not stat.S_ISREG(info.st_mode):  # a directory, /dev/zero, a pipe: never read as records
            result.error = f"is {describe(info.st_mode)}, not a TFRecord file"
            return result
        with open(path, "rb"):
            pass
        result.compression = detect_compression(path)
    except OSError as err:
        result.error = f"cannot read: {err.strerror or err}"
        return result
    if result.bytes == 0:
        result.error = "empty file: no records"
        return result

    out = Path(task.out_dir)
    clean = TFRecordWriter(out / "clean" / task.shard_name)
    quarantine = TFRecordWriter(out / "quarantine" / task.shard_name)
    progress = _Progress(task.progress, plain=result.compression is None)

    def on_damage(damage):
        entry = {"start": damage.start, "end": damage.end,
                 "record_number": damage.record_number, "reason": damage.reason}
        if damage.compressed_start is not None:  # GZIP/ZLIB: start/end are decompressed offsets
            entry.update(compressed_start=damage.compressed_start, compressed_end=damage.compressed_end)
        result.damaged.append(entry)

    try:
        for number, offset, data in iter_records_with_offsets(path, on_damage=on_damage):
            data = bytes(data)
            while len(result.offsets) < number:  # record numbers are dense; never expected to pad
                result.offsets.append(-1)
            result.offsets.append(offset)
            problems, summary = check_record(data, task.schema, task.max_pixels)
            if problems:
                quarantine.write(data)
                result.quarantined_records.append(number)
                for check in {c for c, _ in problems}:
                    result.checks[check] += 1
                result.reasons.extend({"record_number": number, "check": c, "detail": d} for c, d in problems)
            else:
                clean.write(data)
                result.clean_records.append(number)
                _keep_summary(result, number, summary)
            progress.step(offset + len(data) + 16)
    except DataError as err:  # strict-mode errors are not used; this is an unreadable stream
        result.error = str(err).removeprefix(f"{path}: ")
    finally:
        for writer, records in ((clean, result.clean_records), (quarantine, result.quarantined_records)):
            if records:
                writer.close()
            else:
                writer.abort()  # no empty shards
        progress.finish(result.bytes)
    if result.damaged:
        result.checks["framing"] += len(result.damaged)
        if not len(result.offsets) and result.compression:
            first = result.damaged[0]
            result.error = (f"{result.compression} file: no record could be recovered "
                            f"({first['reason']}, decompressed byte {first['start']})")
        elif not len(result.offsets):
            result.error = f"not a TFRecord file: no record framing found in its {result.bytes} bytes"
    return result


def check_record(data: bytes, schema: dict, max_pixels: int) -> tuple[list, dict]:
    """(problems [(check, detail)], summary) for one record; problems mean quarantine."""
    try:
        example = decode_example(data)
    except DataError as err:
        return [("parse", str(err))], {}
    label_key, image_key = schema.get("label_key"), schema.get("image_key")
    problems = validate(example, schema, skip=(label_key, image_key))
    # The image feature too is judged as training judges it: one bytes value, whatever the sample said.
    image_wrong = image_problem(example.get(image_key), image_key) if image_key else None
    if image_wrong:
        problems.insert(0, image_wrong)
    summary: dict = {"numeric": {}}
    label = example.get(label_key) if label_key else None
    # The label is judged as training judges it (data_tools.labels), so what passes here trains.
    label_wrong = label_problem(label, label_key, schema_num_classes(schema)) if label_key else None
    if label_wrong:
        problems.insert(0, label_wrong)
    elif label_key:
        summary["label"] = int(label[0])
        text = example.get("image/class/text")
        if isinstance(text, list) and len(text) == 1:
            summary["class_name"] = text[0][:64].decode("utf-8", "replace")
    for key, spec in schema["features"].items():
        value = example.get(key)
        if (key != label_key and spec["dtype"] != "bytes" and spec.get("max_count") == 1
                and value is not None and len(value) == 1 and not isinstance(value, list)):
            summary["numeric"][key] = float(value[0])
    encoded = example.get(image_key) if image_key else None
    if isinstance(encoded, list) and len(encoded) == 1 and not problems:
        encoded = encoded[0]
        try:
            probe = probe_image(encoded, max_pixels)
        except ImageProblem as err:
            return [(err.check, err.detail)], {}
        if schema.get("mask_key"):
            problem, summary["mask"] = mask_summary(example, probe.width, probe.height, schema, max_pixels)
            if problem:
                return [problem], {}
            summary["mask_note"] = empty_mask_note(summary["mask"], schema["ignore_label"])
        if schema.get("box_keys"):
            problem, summary["boxes"] = box_summary(example, probe.width, probe.height, schema)
            if problem:
                return [problem], {}
        summary.update(content=content_hash(encoded), phash=probe.phash, image=probe, encoded_size=len(encoded))
        declared = example.get("image/format")
        if isinstance(declared, list) and declared and declared[0].decode("ascii", "replace").lower() not in (
                probe.format, "jpg" if probe.format == "jpeg" else probe.format):
            summary["note"] = ("format_mismatch", f"image/format says {declared[0]!r}, the bytes are {probe.format}")
    else:
        summary["content"] = content_hash(data)
    return problems, summary


def _keep_summary(result: FileResult, number: int, summary: dict) -> None:
    if "label" in summary:
        result.labels.append(number, summary["label"])
        if "class_name" in summary:
            result.class_names.setdefault(summary["label"], summary["class_name"])
    result.hash_numbers.append(number)
    result.content_hashes += summary["content"]
    result.perceptual_hashes.append(summary.get("phash") or 0)
    result.has_perceptual_hash.append("phash" in summary)
    probe = summary.get("image")
    if probe is not None:
        values = {"brightness": probe.brightness, "contrast": probe.contrast, "width": probe.width,
                  "height": probe.height, "aspect": probe.width / probe.height,
                  "encoded_size": summary["encoded_size"]}
        for name, value in values.items():
            result.stats.setdefault(name, Column()).append(number, float(value))
    for key, value in summary["numeric"].items():
        result.stats.setdefault(key, Column()).append(number, value)
    if summary.get("mask") is not None:
        result.masks[number] = summary["mask"]
    if summary.get("boxes") is not None:
        result.boxes[number] = summary["boxes"]
    box_lines = box_notes(summary["boxes"]) if summary.get("boxes") is not None else []
    for note in (summary.get("note"), summary.get("mask_note"), *box_lines):
        if not note:
            continue
        check, detail = note
        result.notes.append((number, check, detail))
        result.checks[check] += 1


class _Progress:
    """Sends (records, bytes) increments to the parent's progress bar a few times a second."""

    def __init__(self, queue, plain: bool):
        self.queue, self.plain = queue, plain
        self.records = self.reported_bytes = self.bytes = 0
        self.last = time.monotonic()

    def step(self, position: int) -> None:
        self.records += 1
        if self.plain:  # offsets of a compressed file count decompressed bytes: report at the end
            self.bytes = position
        if self.queue is not None and (self.records >= 500 or time.monotonic() - self.last > 0.25):
            self._send()

    def _send(self) -> None:
        if self.queue is not None:
            self.queue.put((self.records, self.bytes - self.reported_bytes))
        self.reported_bytes, self.records, self.last = self.bytes, 0, time.monotonic()

    def finish(self, file_bytes: int) -> None:
        self.bytes = file_bytes
        self._send()


def shard_names(paths: list[str]) -> list[str]:
    """Clean/quarantine shard name per input: its file name, made unique, without .gz/.zlib."""
    names, seen = [], Counter()
    for p in paths:
        name = os.path.basename(os.path.normpath(p)) or "input"
        for suffix in (".gz", ".gzip", ".zlib", ".zz"):
            name = name.removesuffix(suffix)
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}.{seen[name]}")
    return names
