// Detection post-processing on the device: raw head outputs -> boxes, with no Python.
//
// The same definition as appliance/tasks/detection_decode.py (the host's), step for step, in
// float32; tests/deploy/test_detection_decode_native.py feeds both the same raw outputs and
// requires the same boxes. Every constant comes from the model card's "detection" block.
//
//   raw [P, 5 + K] per image, P = grid * grid points, row-major; point (i, j) at
//   x = (j + 0.5) * stride, y = (i + 0.5) * stride.
//   1. box = (x - d_l, y - d_t, x + d_r, y + d_b), d = stride * exp(min(raw, max_log_distance)),
//      clipped to [0, image_size]; score of class c = sqrt(sigmoid(class c) * sigmoid(centerness));
//   2. keep (point, class) pairs with score > score_threshold; the pre_nms_top_k best
//      (score descending, then point, then class ascending);
//   3. per class, greedy NMS in that order: drop a box whose IoU with a kept box of its class > iou_threshold;
//   4. the max_detections best kept boxes, in that order. Labels are class + 1 (label maps start at 1).
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>

// a * b + c is never fused into one rounding (aarch64 compilers contract by default): the host rounds twice.
#pragma STDC FP_CONTRACT OFF

namespace detection {

struct Spec {
  int image_size = 0, stride = 8, num_classes = 0, max_detections = 100, pre_nms_top_k = 1000;
  float score_threshold = 0.05f, iou_threshold = 0.5f, max_log_distance = 10.0f;
  int grid() const { return image_size / stride; }
};

struct Box {
  float x0, y0, x1, y1, score;
  int label;  // 1..K
};

inline float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

inline float iou(const float* a, const float* b) {
  float w = std::max(0.0f, std::min(a[2], b[2]) - std::max(a[0], b[0]));
  float h = std::max(0.0f, std::min(a[3], b[3]) - std::max(a[1], b[1]));
  float inter = w * h;
  float area_a = (a[2] - a[0]) * (a[3] - a[1]);
  float area_b = (b[2] - b[0]) * (b[3] - b[1]);
  float un = area_a + area_b - inter;
  return un > 0.0f ? inter / un : 0.0f;
}

// The boxes of one image's raw outputs (raw: P x (5 + K) floats, row-major).
inline std::vector<Box> decode(const float* raw, const Spec& spec) {
  const int grid = spec.grid(), points = grid * grid, k = spec.num_classes, row = 5 + k;
  const float stride = static_cast<float>(spec.stride), size = static_cast<float>(spec.image_size);
  std::vector<float> boxes(static_cast<size_t>(points) * 4);
  struct Candidate { float score; int point, cls; };
  std::vector<Candidate> found;
  for (int p = 0; p < points; ++p) {
    const float* r = raw + static_cast<size_t>(p) * row;
    float px = (static_cast<float>(p % grid) + 0.5f) * stride, py = (static_cast<float>(p / grid) + 0.5f) * stride;
    float d[4];
    for (int i = 0; i < 4; ++i) d[i] = stride * std::exp(std::min(r[i], spec.max_log_distance));
    float b[4] = {px - d[0], py - d[1], px + d[2], py + d[3]};
    for (int i = 0; i < 4; ++i) boxes[static_cast<size_t>(p) * 4 + i] = std::min(std::max(b[i], 0.0f), size);
    float centerness = sigmoid(r[4]);
    for (int c = 0; c < k; ++c) {
      float score = std::sqrt(sigmoid(r[5 + c]) * centerness);
      if (score > spec.score_threshold) found.push_back({score, p, c});
    }
  }
  std::stable_sort(found.begin(), found.end(), [](const Candidate& a, const Candidate& b) { return a.score > b.score; });
  if (static_cast<int>(found.size()) > spec.pre_nms_top_k) found.resize(spec.pre_nms_top_k);
  std::vector<Box> kept;
  std::vector<std::vector<int>> kept_points(static_cast<size_t>(k));
  for (const Candidate& c : found) {
    const float* box = &boxes[static_cast<size_t>(c.point) * 4];
    bool suppressed = false;
    for (int q : kept_points[c.cls]) {
      if (iou(box, &boxes[static_cast<size_t>(q) * 4]) > spec.iou_threshold) { suppressed = true; break; }
    }
    if (suppressed) continue;
    kept_points[c.cls].push_back(c.point);
    kept.push_back({box[0], box[1], box[2], box[3], c.score, c.cls + 1});
    if (static_cast<int>(kept.size()) == spec.max_detections) break;
  }
  return kept;
}

}  // namespace detection
