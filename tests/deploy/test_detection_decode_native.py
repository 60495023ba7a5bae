"""One definition of detection decoding, two implementations: the host's Python
(appliance/tasks/detection_decode.py) and the device runner's C++ (appliance/deploy/edge/detection_decode.h),
fed the same raw head outputs, give the same boxes."""

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from appliance.tasks.detection_decode import decode_image, decoding_spec

HEADER_DIR = Path(__file__).resolve().parents[2] / "appliance" / "deploy" / "edge"
DRIVER = r"""
#include <cstdio>
#include <cstdlib>
#include <vector>
#include "detection_decode.h"
int main(int argc, char** argv) {
  detection::Spec s;
  s.image_size = atoi(argv[2]); s.stride = atoi(argv[3]); s.num_classes = atoi(argv[4]);
  s.max_detections = atoi(argv[5]); s.pre_nms_top_k = atoi(argv[6]);
  s.score_threshold = strtof(argv[7], nullptr); s.iou_threshold = strtof(argv[8], nullptr);
  int images = atoi(argv[9]);
  size_t per = (size_t)s.grid() * s.grid() * (5 + s.num_classes);
  std::vector<float> raw(per * images);
  FILE* f = fopen(argv[1], "rb");
  if (fread(raw.data(), sizeof(float), raw.size(), f) != raw.size()) return 2;
  fclose(f);
  for (int i = 0; i < images; ++i)
    for (const auto& b : detection::decode(raw.data() + per * i, s))
      printf("%d %d %.9g %.9g %.9g %.9g %.9g\n", i, b.label, b.score, b.x0, b.y0, b.x1, b.y1);
  return 0;
}
"""


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    compiler = shutil.which("g++") or shutil.which("c++")
    assert compiler, "a C++ compiler (g++) is needed: installer/bootstrap.sh --system installs it"
    folder = tmp_path_factory.mktemp("decode")
    (folder / "driver.cc").write_text(DRIVER)
    done = subprocess.run([compiler, "-std=c++17", "-O2", f"-I{HEADER_DIR}", str(folder / "driver.cc"), "-o",
                           str(folder / "driver")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return folder / "driver"


@pytest.mark.parametrize("seed, k, size, top_k, score, iou", [
    (0, 3, 64, 100, 0.05, 0.5), (1, 1, 96, 20, 0.3, 0.45), (2, 5, 48, 7, 0.05, 0.6), (3, 2, 64, 100, 0.5, 0.3)])
def test_python_and_cpp_decode_the_same_boxes(native, tmp_path, seed, k, size, top_k, score, iou):
    rng = np.random.default_rng(seed)
    spec = decoding_spec(size, 8, k, score_threshold=score, iou_threshold=iou, max_detections=top_k,
                         pre_nms_top_k=300)
    p = spec["grid"] ** 2
    raw = np.concatenate([rng.normal(0.8, 0.6, (4, p, 4)), rng.normal(0, 2, (4, p, 1)),
                          rng.normal(-2, 2.5, (4, p, k))], 2).astype(np.float32)
    raw[0, :5, :4] = 40.0  # past max_log_distance: clamped the same way on both sides
    raw[1, :, 5:] = -30.0  # an image with no box above the threshold
    (tmp_path / "raw.bin").write_bytes(raw.tobytes())
    done = subprocess.run([str(native), str(tmp_path / "raw.bin"), str(size), "8", str(k), str(top_k), "300",
                           repr(score), repr(iou), "4"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    rows = np.array([list(map(float, line.split())) for line in done.stdout.splitlines()]).reshape(-1, 7)
    suppressed = 0
    for image in range(4):
        boxes, scores, labels = decode_image(raw[image], spec)
        cpp = rows[rows[:, 0] == image]
        assert len(cpp) == len(boxes), (image, len(cpp), len(boxes))
        assert cpp[:, 1].astype(int).tolist() == labels.tolist()
        assert np.allclose(cpp[:, 2], scores, rtol=1e-6, atol=0)
        assert np.allclose(cpp[:, 3:], boxes, rtol=1e-6, atol=1e-4)
        candidates = int((np.sqrt(1 / (1 + np.exp(-raw[image, :, 5:])) / (1 + np.exp(-raw[image, :, 4:5]))) > score).sum())
        suppressed += min(candidates, 300) - len(boxes)
    assert len(rows) > 0 and suppressed > 0  # NMS or top-k did work, on both sides alike
