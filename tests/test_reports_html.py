"""Every HTML report rendered in headless Chromium, measured in the rendered page, as a person would look at it.

A copy of each report gets a small script that writes what the browser laid out (image sizes,
text outside its chart, words split across lines, empty tables and charts) into the DOM, and
`chromium --dump-dom` hands that back. The reports themselves carry no script.
"""

from __future__ import annotations

import html
import io
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent / "data_tools"))

from check_datasets import make_planted  # noqa: E402

CHROMIUM = "/usr/bin/chromium"

MEASURE = r"""
<script>
addEventListener("load", () => {
  const out = {images: [], svgs: [], broken_words: [], empty_tables: [], text: document.body.innerText};
  for (const img of document.querySelectorAll("img")) {
    const r = img.getBoundingClientRect();
    out.images.push({width: r.width, height: r.height, natural: [img.naturalWidth, img.naturalHeight],
                     rendering: getComputedStyle(img).imageRendering, alt: img.alt});
  }
  for (const svg of document.querySelectorAll("svg")) {
    const box = svg.getBoundingClientRect();
    const info = {id: svg.id, cls: svg.getAttribute("class") || "", marks: 0, rects: 0, clipped: [],
                  texts: [...svg.querySelectorAll("text")].map(t => t.textContent),
                  ticks: [...svg.querySelectorAll("text.tick")].map(t => t.textContent)};
    for (const t of svg.querySelectorAll("text")) {
      const b = t.getBoundingClientRect();
      if (b.left < box.left - 0.5 || b.right > box.right + 0.5 || b.top < box.top - 0.5 || b.bottom > box.bottom + 0.5)
        info.clipped.push(t.textContent);
    }
    for (const r of svg.querySelectorAll("rect")) {
      info.rects++;
      const b = r.getBoundingClientRect();
      if (b.width > 0 && b.height > 0) info.marks++;
    }
    out.svgs.push(info);
  }
  // A break between two letters or digits splits a word ("arou|nd"); after "-", "/" or "." (paths) it does not.
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const top = (node, i) => {
    const range = document.createRange();
    range.setStart(node, i);
    range.setEnd(node, i + 1);
    const rects = [...range.getClientRects()].filter(r => r.width > 0);
    return rects.length ? Math.round(rects[0].top) : null;
  };
  for (let node = walker.nextNode(); node; node = walker.nextNode()) {
    if (node.parentElement.closest("svg, script, style")) continue;
    for (const m of node.textContent.matchAll(/[^\s]+/g)) {
      let previous = top(node, m.index);
      for (let i = 1; i < m[0].length; i++) {
        const now = top(node, m.index + i);
        if (now !== null && previous !== null && now !== previous && /[A-Za-z0-9][A-Za-z0-9]/.test(m[0].slice(i - 1, i + 1)))
          out.broken_words.push(m[0]);
        if (now !== null) previous = now;
      }
    }
  }
  // Horizontal overflow at the window's width: the page scrolls sideways, or an element runs past its right edge.
  out.overflow = {page: document.documentElement.scrollWidth - document.documentElement.clientWidth, elements: []};
  for (const el of document.body.querySelectorAll("*")) {
    if (el.closest("svg") && el.tagName.toLowerCase() !== "svg") continue;
    const r = el.getBoundingClientRect();
    if (r.width > 0 && r.right > document.documentElement.clientWidth + 0.5)
      out.overflow.elements.push(el.tagName.toLowerCase() + ": " + (el.textContent || "").slice(0, 60));
  }
  out.pre = document.querySelectorAll("pre").length;
  for (const table of document.querySelectorAll("table"))
    if (table.rows.length < 2) out.empty_tables.push(table.outerHTML.slice(0, 200));
  const pre = document.createElement("pre");
  pre.id = "measurements";
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
</script>
"""


def measure(page: Path, tmp_path: Path, width: int = 1280) -> dict:
    """Render page (offline) with the measuring script added; what the browser laid out."""
    if not Path(CHROMIUM).exists():
        pytest.fail("chromium is required for the report tests (installer/bootstrap.sh --system)")
    text = page.read_text()
    assert "<script" not in text, f"{page.name}: reports are plain HTML"
    probe = page.with_name(f"measured-{page.name}")
    probe.write_text(text.replace("</body>", MEASURE + "</body>"))
    cmd = ["unshare", "-n", CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
           "--disable-background-networking", "--disable-component-update", "--disable-sync",
           f"--user-data-dir={tmp_path / 'chromium-profile'}", f"--window-size={width},1000",
           "--virtual-time-budget=5000", "--dump-dom", probe.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    found = re.search(r'<pre id="measurements">(.*?)</pre>', proc.stdout, re.S)
    assert found, f"{page.name}: the measuring script did not run: {proc.stdout[-500:]}"
    return json.loads(html.unescape(found.group(1)))


def assert_readable(m: dict, page: str) -> None:
    """What any report must get right: no text cut off at a chart's edge, no word broken mid-word, no empty table."""
    for svg in m["svgs"]:
        assert not svg["clipped"], f"{page}: text outside chart {svg['id'] or svg['cls']}: {svg['clipped']}"
    assert not m["broken_words"], f"{page}: words broken across lines: {m['broken_words'][:10]}"
    assert not m["empty_tables"], f"{page}: a table with no rows: {m['empty_tables']}"
    assert m["overflow"]["page"] <= 0 and not m["overflow"]["elements"], f"{page}: wider than 1,280 px: {m['overflow']}"
    assert m["pre"] == 0, f"{page}: a preformatted block (tables are HTML tables)"


# ---- the data check report -------------------------------------------------------------------------

def small_png(rng: np.random.Generator, brightness: int) -> bytes:
    """An 8x8 image (like scikit-learn's digits): textured, around the given brightness."""
    pixels = np.clip(rng.normal(brightness, 40, (8, 8)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels, "L").save(out, format="PNG")
    return out.getvalue()


def write_small_images(path: Path, count: int, seed: int = 0) -> Path:
    """count 8x8 PNG records in 4 classes named "0".."3" (as digits are), two much brighter than the rest."""
    from data_tools.example import encode_example
    from data_tools.tfrecord import write_records

    rng = np.random.default_rng(seed)
    records = []
    for i in range(count):
        label = i % 4
        records.append(encode_example({"image/encoded": small_png(rng, 250 if i in (5, 11) else 90),
                                       "image/format": b"png", "image/class/label": label,
                                       "image/class/text": str(label).encode()}))
    write_records(path, records)
    return path


def test_data_check_report_of_small_images_that_all_pass(tmp_path):
    from data_tools.check.run import run_check

    data = write_small_images(tmp_path / "digits-like-images-of-eight-pixels.tfrecord", 60)
    out = tmp_path / "checked"
    report, status = run_check([(str(data), None)], out, progress=False)  # from Python: no command line
    assert status == 0 and report["records_quarantined"] == 0 and not report["checks"]
    assert report["metrics"]["outliers"] >= 2

    page = (out / "report.html").read_text()
    remake = re.search(r"remake with: (.*?) -->", page).group(1)
    assert remake.startswith("appliance data check ") and str(data) in remake and f"--out {out}" in remake

    m = measure(out / "report.html", tmp_path)
    assert_readable(m, "report.html")
    assert f"No record failed a check: all {report['records_total']} records" in m["text"]
    balance = next(s for s in m["svgs"] if s["id"] == "plot-label-balance")
    assert balance["ticks"] == ["0", "1", "2", "3"]  # not "0 0": the class names are the labels
    assert balance["marks"] == 4
    thumbs = [i for i in m["images"] if i["alt"].startswith("record ")]
    assert len(thumbs) >= 2
    for image in thumbs:
        assert image["natural"] == [8, 8]  # the thumbnail PNG keeps the image's pixels...
        assert image["width"] >= 48 and image["height"] >= 48, image  # ...shown large enough to see
        assert image["rendering"] == "pixelated", image


def test_data_check_report_with_failures_and_cut_lists(tmp_path, monkeypatch):
    from data_tools.check import thumbnails
    from data_tools.check.run import run_check

    planted = make_planted(tmp_path / "data", per_class=12, minority=2)
    monkeypatch.setattr(thumbnails, "MAX_OUTLIERS", 1)  # the report shows the first outlier only
    monkeypatch.setattr(thumbnails, "MAX_GROUPS", 1)
    out = tmp_path / "out"
    report, status = run_check([(str(planted.train), "train"), (str(planted.val), "val")], out, progress=False,
                               fail_on="imbalance>3", command=["appliance", "data", "check", "--train", "t"])
    assert status == 3 and report["metrics"]["outliers"] >= 2 and len(report["duplicates"]["exact_groups"]) >= 2
    assert "remake with: appliance data check --train t -->" in (out / "report.html").read_text()

    m = measure(out / "report.html", tmp_path)
    assert_readable(m, "report.html")
    assert "Gate: FAILED" in m["text"] and "blank_image" in m["text"]
    assert f"shown 1 of {report['metrics']['outliers']} outlier records" in m["text"]
    assert f"shown 1 of {len(report['duplicates']['exact_groups'])} exact-duplicate groups" in m["text"]
    balance = next(s for s in m["svgs"] if s["id"] == "plot-label-balance")
    assert balance["ticks"] == ["0 cat", "1 dog", "2 owl", "3 fox", "4 eel"]
    histograms = [s for s in m["svgs"] if s["id"].startswith("plot-stat-")]
    assert len(histograms) == 6 and all(s["marks"] > 0 and len(s["ticks"]) == 3 for s in histograms)
    thumbs = [i for i in m["images"] if i["alt"].startswith("record ")]
    assert thumbs and all(min(i["width"], i["height"]) >= 48 for i in thumbs), thumbs


# ---- the deploy reports ----------------------------------------------------------------------------

def logits(seed: int = 0, samples: int = 40, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 3, (samples, classes)).astype(np.float32)


def with_outliers(host: np.ndarray) -> np.ndarray:
    """The same logits, a few samples off by 3e-3 (over the default limit), the rest by 1e-7 or exactly 0."""
    edge = host.copy()
    edge[::2] += np.float32(1e-6)
    edge[[3, 17, 29], 1] += np.float32(3e-3)
    return edge


def verify_page(tmp_path: Path, edge: np.ndarray, host: np.ndarray) -> tuple[dict, Path]:
    from appliance.deploy.verify import compare_with_host, verify_html

    route = compare_with_host("native runner (qemu-aarch64)", edge, host, 1.2, "edge-package.tar", 1.0, 1e-4)
    report = {"made_by": "appliance edge verify", "package": str(tmp_path / "edge-package.tar"),
              "samples": len(host), "sample_source": "tfrecord", "min_agreement": 1.0, "routes": [route],
              "passed": route["passed"]}
    page = tmp_path / "verify.html"
    page.write_text(verify_html(report))
    return route, page


def test_verify_report_when_edge_and_host_are_identical(tmp_path):
    host = logits()
    route, page = verify_page(tmp_path, host.copy(), host)
    assert route["max_logit_diff"] == 0.0
    m = measure(page, tmp_path)
    assert_readable(m, "verify.html")
    assert f"identical on all {len(host)} samples" in m["text"]
    assert not [s for s in m["svgs"] if "columns" in s["cls"]], "an empty log chart is drawn for zero differences"


def test_verify_report_with_outliers(tmp_path):
    host = logits()
    route, page = verify_page(tmp_path, with_outliers(host), host)
    assert not route["passed"]
    m = measure(page, tmp_path)
    assert_readable(m, "verify.html")
    [chart] = [s for s in m["svgs"] if "columns" in s["cls"]]
    identical = sum(1 for v in route["max_logit_diff_per_sample"] if v == 0)
    assert chart["rects"] == len(host) and chart["marks"] == len(host) - identical
    assert f"{len(host)} samples; {identical} identical" in m["text"] and "3 above the allowed" in m["text"]


@pytest.mark.parametrize("case", ["identical", "outliers"])
def test_export_parity_report(tmp_path, case):
    from appliance.deploy.export import parity_html, parity_report

    expected = logits(1)
    got = expected.copy() if case == "identical" else with_outliers(expected)
    report = {"parity": parity_report(expected, got, "tfrecord", 1e-5)}
    page = tmp_path / "parity.html"
    page.write_text(parity_html(report, np.abs(expected - got).max(1)))
    m = measure(page, tmp_path)
    assert_readable(m, "parity.html")
    charts = [s for s in m["svgs"] if "columns" in s["cls"]]
    if case == "identical":
        assert not charts and f"identical on all {len(expected)} samples" in m["text"]
    else:
        assert len(charts) == 1 and charts[0]["marks"] > 0


@pytest.mark.parametrize("mode", ["int8", "fp16"])
def test_quantize_accuracy_report(tmp_path, mode):
    from appliance.deploy.accuracy_report import compare, write_reports

    fp32, quantized = tmp_path / "model.onnx", tmp_path / f"model.{mode}.onnx"
    fp32.write_bytes(bytes(40_000))
    quantized.write_bytes(bytes(11_000 if mode == "int8" else 20_000))
    labels = np.arange(48) % 4
    report = compare(fp32, quantized, {"predictions": labels, "top1": 1.0, "latency_ms_median": 1.5},
                     {"predictions": np.roll(labels, 1), "top1": 0.0, "latency_ms_median": 0.5}, mode, 48, 1.0)
    write_reports(tmp_path, report)
    m = measure(tmp_path / "accuracy.html", tmp_path)
    assert_readable(m, "accuracy.html")
    bars = [s for s in m["svgs"] if "bars" in s["cls"]]
    assert len(bars) == 3 and [s["marks"] for s in bars] == [1, 2, 2]  # a 0 % top-1 draws no bar
    assert "FAIL" in m["text"]


# ---- the estimate, the pipeline's index, the training report -------------------------------------

def estimate_row(arch: str, fp32_ms, int8_ms) -> dict:
    def build(ms_a76, size):
        device = ({"estimated": True, "method": "m", "instructions": 1,
                   **{cpu: {"cycles": 1e6, "ms": ms_a76 * k, "clock_ghz": 2.0} for cpu, k in
                      (("cortex-a76", 1.0), ("cortex-a55", 2.3))}} if ms_a76 is not None else
                  {"estimated": False, "reason": "wheelhouse/edge-sysroot-arm64: missing"})
        return {"library_bytes": size, "device_estimate": device, "int8_layers": 53, "int8_on_our_kernels": 53,
                "int8_generic": 0, "int8_kernel_kind": "dotprod"}
    return {"architecture": arch, "parameters": 5_288_548, "size": 224, "target": "aarch64-dotprod",
            "fp32": build(fp32_ms, 21_300_000), "int8": build(int8_ms, 6_100_000), "seconds": 60.0}


def test_estimate_report_is_a_table_with_every_bar_named_whole(tmp_path):
    """issue 43: estimate.html printed its table as Markdown in a <pre> that ran off the page, and
    labelled both bars of efficientnet_b0 "efficientnet_b" (labels were cut at 14 characters)."""
    from appliance.deploy.estimate import estimate_html

    table = {"made_by": "appliance edge estimate", "target": "aarch64-dotprod", "size": 224, "classes": 1000,
             "method": "qemu-aarch64 block counts (tbcount plugin) costed by llvm-mca-16; L1 hits only, one thread",
             "clocks_ghz": {"cortex-a76": 2.4, "cortex-a55": 1.8}, "seconds": 100.0,
             "rows": [estimate_row("efficientnet_b0", 31.5, 12.25), estimate_row("mobilenet_v3_small", 4.0, 2.5),
                      estimate_row("shufflenet_v2_x1_0", None, None)]}
    page = tmp_path / "estimate.html"
    page.write_text(estimate_html(table))
    m = measure(page, tmp_path)
    assert_readable(m, "estimate.html")
    [chart] = [s for s in m["svgs"] if "bars" in s["cls"]]
    for label in ("efficientnet_b0 TVM fp32", "efficientnet_b0 TVM int8", "mobilenet_v3_small TVM fp32",
                  "mobilenet_v3_small TVM int8"):
        assert label in chart["texts"], chart["texts"]
    assert chart["marks"] == 4
    assert "shufflenet_v2_x1_0" in m["text"] and "not estimated: wheelhouse/edge-sysroot-arm64: missing" in m["text"]
    assert "|---|" not in m["text"] and "| architecture |" not in m["text"]


def test_pipeline_index_names_every_stage_whole(tmp_path):
    """issue 43: index.html showed "val_majority_b" and "quality_gate_r"."""
    from appliance.pipeline.summary import index_html

    accuracy = {"train_val_top1": 0.9512, "val_majority_baseline_top1": 0.2031, "quality_gate_reference_top1": 0.9,
                "export_onnx_top1": 0.9512, "quantize_int8_top1": 0.9487, "edge_device_agreement_top1": 1.0,
                "quantize_top1_drop_points": 0.25}
    summary = {"out_dir": str(tmp_path), "ran": [], "config": str(tmp_path / ("a-long-pipeline-config-name" * 3)) + ".toml",
               "seconds": 123.4, "accuracy": accuracy, "sizes_bytes": {"model.onnx": 1_234_567, "model.int8.onnx": 345_678},
               "latency_ms": {"host fp32": 1.234, "host int8": 0.987}, "task": {"metric": "top1", "metric_label": "top-1"},
               "quality_gate": {"passed": True}}
    from types import SimpleNamespace

    from appliance.core.manifest import write_manifest

    results = {}
    for stage in ("check", "train", "export", "quantize", "compile", "package", "verify"):
        out = tmp_path / stage
        out.mkdir()
        (out / "report.html").write_text("<p>report</p>")
        write_manifest(out, stage, [], {}, [out / "report.html"])
        results[stage] = SimpleNamespace(out_dir=out)  # what index_html reads of a stage result: its directory
    page = tmp_path / "index.html"
    page.write_text(index_html(summary, results))
    m = measure(page, tmp_path)
    assert_readable(m, "index.html")
    [chart] = [s for s in m["svgs"] if "bars" in s["cls"]]
    for label in ("val_majority_baseline", "quality_gate_reference", "edge_device_agreement", "quantize_int8"):
        assert label in chart["texts"], chart["texts"]


def test_training_report_with_long_class_names(tmp_path):
    from appliance.train.report import write_training_report

    names = ["background", "scratch-on-the-left-edge", "spot", "crack_across_the_whole_part", "dent"]
    lines = []
    for step in range(10, 110, 10):
        lines.append({"step": step, "loss": 2.0 / step, "train_acc": step / 120, "lr": 0.1, "grad_norm": 1.5,
                      "clipped_fraction": 0.1})
        if step % 50 == 0:
            confusion = [[40 if i == j else 3 for j in range(5)] for i in range(5)]
            lines.append({"step": step, "epoch": step // 50 - 1, "val_loss": 1.0, "val_acc": 0.8, "val_confusion": confusion})
    run = tmp_path / "run-with-a-name"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    _, page = write_training_report(run, names)
    m = measure(page, tmp_path)
    assert_readable(m, "report.html")
    for name in names:
        assert name in m["text"]


def test_segmentation_check_report_names_classes_from_the_config(tmp_path):
    """issue 43: the segmentation check report showed class ids only, and "Label balance: No labels found"."""
    sys.path.insert(0, str(Path(__file__).resolve().parent / "train"))
    from seg_data import seg_records

    from appliance.tasks import task_for
    from data_tools.check.run import run_check
    from data_tools.tfrecord import write_records

    data = tmp_path / "inspection.tfrecord"
    write_records(data, list(seg_records(24, 0)))
    names = ["background", "scratch-on-the-surface", "spot", "crack"]
    options = task_for({"kind": "segmentation"}).check_options(len(names), names)  # what the pipeline passes
    report, status = run_check([(str(data), "train")], tmp_path / "out", progress=False, **options)
    assert status == 0 and report["segmentation"]["class_names"] == {str(i): n for i, n in enumerate(names)}
    m = measure(tmp_path / "out" / "report.html", tmp_path)
    assert_readable(m, "report.html")
    assert "No labels found" not in m["text"] and "The masks are the labels" in m["text"]
    share = next(s for s in m["svgs"] if s["id"] == "plot-pixel-share")
    assert share["ticks"] == [f"{i} {n}" for i, n in enumerate(names)], share["ticks"]
