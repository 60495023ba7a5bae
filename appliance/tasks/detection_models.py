"""Detection networks that end at their raw head outputs, and the FCOS loss that trains them.

Every network here returns raw [N, P, 5 + K] (see appliance.tasks.detection_decode for what the
numbers mean): an ONNX export of it holds convolutions and a reshape only, so every runtime and
TVM take it, and decoding + NMS run after it (Python on the host, C++ on the device).

fcos_tiny: a small anchor-free single-stage detector of ours (FCOS's head on a four-stage
convolution backbone, one stride-8 level), for the demo and for small-object inspection data.

The loss is FCOS's as torchvision's FCOS.compute_loss defines it: sigmoid focal loss on the class
logits (alpha 0.25, gamma 2) over every point, GIoU loss on the decoded boxes and binary
cross-entropy on centerness over the foreground points, each divided by the number of foreground
points; a point is foreground for the smallest ground-truth box that holds it and whose centre
is within 1.5 strides of it (FCOS's centre sampling).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torchvision.ops import generalized_box_iou_loss, sigmoid_focal_loss

from appliance.tasks.detection_decode import MAX_LOG_DISTANCE

DETECTION_STRIDES = {"fcos_tiny": 8}
CENTER_SAMPLING_RADIUS = 1.5


def _conv(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class TinyFCOS(nn.Module):
    """Backbone: three stride-2 stages (16, 32, 48 channels), two convolutions each; FCOS towers and heads."""

    stride = 8

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16):
        super().__init__()
        self.num_classes = num_classes
        self.backbone = nn.Sequential(_conv(in_channels, width, 2), _conv(width, width),
                                      _conv(width, 2 * width, 2), _conv(2 * width, 2 * width),
                                      _conv(2 * width, 3 * width, 2), _conv(3 * width, 3 * width))
        c = 3 * width
        self.cls_tower = nn.Sequential(_conv(c, c), _conv(c, c))
        self.box_tower = nn.Sequential(_conv(c, c), _conv(c, c))
        self.cls_logits = nn.Conv2d(c, num_classes, 3, 1, 1)
        self.bbox_reg = nn.Conv2d(c, 4, 3, 1, 1)
        self.centerness = nn.Conv2d(c, 1, 3, 1, 1)
        nn.init.constant_(self.cls_logits.bias, -math.log((1 - 0.01) / 0.01))  # FCOS's prior probability 0.01
        nn.init.constant_(self.bbox_reg.bias, math.log(2.0))  # boxes start two strides wide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.backbone(x)
        c, b = self.cls_tower(f), self.box_tower(f)
        raw = torch.cat([self.bbox_reg(b), self.centerness(b), self.cls_logits(c)], 1)  # [N, 5 + K, G, G]
        return raw.flatten(2).transpose(1, 2)  # [N, P, 5 + K], points row-major


def build_detector(architecture: str, num_classes: int, in_channels: int = 3) -> nn.Module:
    if architecture == "fcos_tiny":
        return TinyFCOS(num_classes, in_channels)
    raise ValueError(f"unknown detection architecture {architecture!r}")


def grid_points(points: int, stride: int, device) -> torch.Tensor:
    """(P, 2) point centres (x, y) in pixels of a square grid of P points, row-major."""
    grid = int(round(math.sqrt(points)))
    c = (torch.arange(grid, dtype=torch.float32, device=device) + 0.5) * stride
    ys, xs = torch.meshgrid(c, c, indexing="ij")
    return torch.stack([xs.reshape(-1), ys.reshape(-1)], 1)


def decode_boxes(raw: torch.Tensor, pts: torch.Tensor, stride: int) -> torch.Tensor:
    """[..., P, 4] pixel boxes of raw distances (the rule of detection_decode, in torch)."""
    d = stride * torch.exp(raw[..., :4].clamp(max=MAX_LOG_DISTANCE))
    return torch.cat([pts - d[..., :2], pts + d[..., 2:]], -1)


class FCOSLoss(nn.Module):
    """loss(raw [N, P, 5 + K], targets [N, M, 5] rows [label (0: padding), xmin, ymin, xmax, ymax] normalised)."""

    def __init__(self, stride: int = 8):
        super().__init__()
        self.stride = stride

    @torch.no_grad()
    def assign(self, targets: torch.Tensor, pts: torch.Tensor, size: float):
        """(matched box index per point or -1 [N, P], gt pixel boxes [N, M, 4])."""
        boxes = targets[..., 1:] * size
        valid = targets[..., 0] > 0
        x, y = pts[None, :, None, 0], pts[None, :, None, 1]  # [1, P, 1]
        b = boxes[:, None]  # [N, 1, M, 4]
        inside = (x > b[..., 0]) & (x < b[..., 2]) & (y > b[..., 1]) & (y < b[..., 3])
        cx, cy = (b[..., 0] + b[..., 2]) / 2, (b[..., 1] + b[..., 3]) / 2
        radius = CENTER_SAMPLING_RADIUS * self.stride
        near = ((x - cx).abs() < radius) & ((y - cy).abs() < radius)
        ok = inside & near & valid[:, None, :]
        area = ((b[..., 2] - b[..., 0]) * (b[..., 3] - b[..., 1])).expand_as(ok)
        area = torch.where(ok, area, torch.full_like(area, float("inf")))
        smallest, index = area.min(-1)
        return torch.where(torch.isfinite(smallest), index, torch.full_like(index, -1)), boxes

    def forward(self, raw: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        raw = raw.float()
        n, p, channels = raw.shape
        pts = grid_points(p, self.stride, raw.device)
        size = float(round(math.sqrt(p)) * self.stride)
        matched, boxes = self.assign(targets, pts, size)
        fg = matched >= 0
        num_fg = fg.sum().clamp(min=1).float()
        labels = torch.gather(targets[..., 0], 1, matched.clamp(min=0)).long()  # [N, P]
        cls_target = torch.zeros_like(raw[..., 5:])
        cls_target[fg] = nn.functional.one_hot(labels[fg] - 1, channels - 5).float()
        loss_cls = sigmoid_focal_loss(raw[..., 5:], cls_target, reduction="sum")
        gt = torch.gather(boxes, 1, matched.clamp(min=0)[..., None].expand(n, p, 4))[fg]  # [F, 4]
        predicted = decode_boxes(raw, pts, self.stride)[fg]
        loss_box = generalized_box_iou_loss(predicted, gt, reduction="sum")
        fp = pts.expand(n, p, 2)[fg]
        lr = torch.stack([fp[:, 0] - gt[:, 0], gt[:, 2] - fp[:, 0]], 1)
        tb = torch.stack([fp[:, 1] - gt[:, 1], gt[:, 3] - fp[:, 1]], 1)
        center = torch.sqrt((lr.min(1).values / lr.max(1).values) * (tb.min(1).values / tb.max(1).values))
        loss_ctr = nn.functional.binary_cross_entropy_with_logits(raw[..., 4][fg], center, reduction="sum")
        return (loss_cls + loss_box + loss_ctr) / num_fg
