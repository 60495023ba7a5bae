"""Segmentation architectures: torchvision's (LR-ASPP, DeepLabV3, FCN) and a small U-Net for the demo.

Every model takes (N, C, H, W) and returns per-pixel class logits (N, K, H, W): torchvision's
models return a dict {"out": ...}, unwrapped here, so training, ONNX export and the edge
runner see one tensor. Weights are never downloaded (the appliance is offline): a classification
backbone's weights come through [model] init (torchvision:NAME from the bundle's weights/, or a
checkpoint), matched by init_weights onto the `net.backbone.` keys.
"""

from __future__ import annotations

import torch
from torch import nn

SEGMENTATION_ARCHITECTURES = ("unet_small", "lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large",
                              "deeplabv3_resnet50", "fcn_resnet50")  # as appliance.tasks.segmentation lists them


class DictOut(nn.Module):
    """A torchvision segmentation model whose forward returns its "out" logits only."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)["out"]


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNetSmall(nn.Module):
    """A three-level U-Net (Ronneberger et al. 2015) with `width` channels at the top: 0.12 M parameters
    at width 16. Input sides must be multiples of 4 (two 2x poolings). Plain Conv/BN/ReLU/MaxPool/
    ConvTranspose/Concat, all of which ONNX, onnxruntime's INT8 and TVM handle."""

    def __init__(self, num_classes: int, in_channels: int = 3, width: int = 16):
        super().__init__()
        w = width
        self.down1, self.down2, self.bottom = _block(in_channels, w), _block(w, 2 * w), _block(2 * w, 4 * w)
        self.pool = nn.MaxPool2d(2)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * w, 2 * w, 2, stride=2), _block(4 * w, 2 * w)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * w, w, 2, stride=2), _block(2 * w, w)
        self.head = nn.Conv2d(w, num_classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(self.pool(d1))
        b = self.bottom(self.pool(d2))
        u2 = self.dec2(torch.cat([self.up2(b), d2], 1))
        u1 = self.dec1(torch.cat([self.up1(u2), d1], 1))
        return self.head(u1)


def _first_conv_to(model: nn.Module, in_channels: int) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.Conv2d):
            new = nn.Conv2d(in_channels, module.out_channels, module.kernel_size, module.stride, module.padding,
                            bias=module.bias is not None)
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], new)
            return


def build_segmentation_model(architecture: str, num_classes: int, in_channels: int = 3) -> nn.Module:
    """A freshly initialised segmentation model (no download); logits (N, num_classes, H, W)."""
    if architecture == "unet_small":
        return UNetSmall(num_classes, in_channels)
    import torchvision

    # aux_loss off: one output; weights and weights_backbone None: nothing is fetched.
    net = getattr(torchvision.models.segmentation, architecture)(weights=None, weights_backbone=None,
                                                                 num_classes=num_classes, aux_loss=False)
    if in_channels != 3:
        _first_conv_to(net, in_channels)
    return DictOut(net)

