"""`appliance edge verify` of a segmentation package: the class per pixel, device against host.

Pixel agreement is the share of pixels whose argmax over the K logits is the same on both; mIoU
of each against the samples' masks uses the task's own IoU arithmetic (the ignore label counts for
nothing). The native runner's PNG class maps are decoded here with PIL and must equal the argmax of
the logits it returned, which checks the device's PNG writer (edge/class_map_png.h) on every run.
"""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from appliance.core.errors import DataError
from appliance.core.html_report import bars_svg
from data_tools.image_decode import ImageProblem, decode_image


def pixel_figures(edge: np.ndarray, host: np.ndarray, labels: np.ndarray | None, task) -> dict:
    """pixel_agreement of (N, K, H, W) logits, and with masks the mIoU and pixel accuracy of both."""
    out = {"pixel_agreement": float((edge.argmax(1) == host.argmax(1)).mean())}
    if labels is not None:
        device, on_host = (task.figures(edge.argmax(1), labels, edge.shape[1]),
                           task.figures(host.argmax(1), labels, host.shape[1]))
        out.update({"miou": device["miou"], "host_miou": on_host["miou"], "pixel_acc": device["pixel_acc"],
                    "host_pixel_acc": on_host["pixel_acc"]})
    return out


def check_class_maps(root: Path, edge: np.ndarray, package) -> dict:
    """The runner's PNG class maps, decoded here: each must be the argmax of the logits it wrote."""
    for i, logits in enumerate(edge):
        path = root / "verify-masks" / f"{i:04d}.png"
        try:  # the bounded decoder: a class map is the device's output, read as untrusted bytes
            image = decode_image(path.read_bytes(), what="class map")
            mode, decoded = image.mode, np.asarray(image)
        except (OSError, ImageProblem) as err:
            raise DataError(f"{package}: bin/run's class map {path.name} is not a readable PNG ({err})") from None
        if mode != "L" or not np.array_equal(decoded, logits.argmax(0)):
            raise DataError(f"{package}: bin/run's class map {path.name} ({mode}, {decoded.shape}) is not the argmax "
                            "of the logits it returned")
    return {"written": int(len(edge)), "format": "PNG, 8-bit greyscale, one class id per pixel",
            "equal_to_logits_argmax": True}


def segmentation_html(report: dict) -> str:
    """Per route: pixel agreement and mIoU against the masks, device beside host; the class-map check."""
    if report.get("task") != "segmentation":
        return ""
    parts = [f"<h2>Segmentation: class per pixel, device vs host (gate: {report['min_agreement'] * 100:.1f}% "
             "of the pixels agree)</h2>"]
    for r in report["routes"]:
        line = f"{html.escape(r['runner'])}: pixel agreement {r['pixel_agreement'] * 100:.3f}%"
        if "miou" in r:
            line += (f"; mIoU against the masks: device {r['miou'] * 100:.2f}%, host {r['host_miou'] * 100:.2f}% "
                     f"(pixel accuracy {r['pixel_acc'] * 100:.2f}% / {r['host_pixel_acc'] * 100:.2f}%)")
            parts.append(bars_svg(f"mIoU: {r['runner']}", "%", [("host (onnxruntime)", r["host_miou"] * 100),
                                                                  ("device (qemu)", r["miou"] * 100)], "{:.2f}"))
        if "class_maps" in r:
            line += f"; {r['class_maps']['written']} PNG class maps decoded, each the argmax of its logits"
        parts.insert(len(parts) - ("miou" in r), f"<p>{line}</p>")
    return "".join(parts)
