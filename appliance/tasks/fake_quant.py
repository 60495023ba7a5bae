"""Quantization-aware training: a model rewritten so that it trains with the INT8 rounding it will run with.

`insert_fake_quant(model)` folds each BatchNorm into the convolution before it (the deployed model has
no BatchNorm either: the QDQ model's weights are the folded ones), then wraps every Conv2d and Linear:
weights fake-quantized per output channel, symmetric int8 in [-127, 127] with scale max|w| / 127 (what
onnxruntime's S8S8 QDQ writes, and what the int8 kernels of `appliance compile` take); the layer's
input fake-quantized per tensor, asymmetric int8 in [-128, 127], its range an exponential moving
average of the batches' min and max (momentum EMA_MOMENTUM), kept in buffers. The buffers are part of
the state dict, so checkpoints carry them and a resumed run is exact.

The ops are torch's own fake_quantize_per_tensor_affine / _per_channel_affine (straight-through
gradients inside the range); torch.onnx.export (TorchScript) writes them as QuantizeLinear +
DequantizeLinear, so the exported model is a QDQ model whose scales came from training.
Used by training (the [qat] section) and by export (a card whose extra says "qat").
"""

from __future__ import annotations

import torch
from torch import nn

EMA_MOMENTUM = 0.01
WEIGHT_QMAX = 127
CARD_KEY = "qat"
CARD_VALUE = {"weights": "int8 per-channel symmetric, scale max|w|/127",
              "activations": "int8 per-tensor asymmetric, EMA min/max", "batchnorm": "folded into conv"}


class ActivationFakeQuant(nn.Module):
    """Per-tensor int8 fake quantization with an EMA-observed range (updated in training mode only)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("range_min", torch.zeros(1))
        self.register_buffer("range_max", torch.zeros(1))
        self.register_buffer("observed", torch.zeros(1))  # 0 until the first training batch
        self.register_buffer("scale", torch.ones(1))
        self.register_buffer("zero_point", torch.zeros(1, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32:  # the int8 grid is a float32 one, under autocast too
            x = x.float()
        if self.training:
            with torch.no_grad():
                lo, hi = x.detach().min().reshape(1), x.detach().max().reshape(1)
                first = self.observed == 0
                m = EMA_MOMENTUM
                self.range_min.copy_(torch.where(first, lo, self.range_min * (1 - m) + lo * m))
                self.range_max.copy_(torch.where(first, hi, self.range_max * (1 - m) + hi * m))
                self.observed.fill_(1)
                self._update_qparams()
        return torch.fake_quantize_per_tensor_affine(x, self.scale, self.zero_point, -128, 127)

    def _update_qparams(self) -> None:
        # The range always holds 0 (zero padding and ReLU zeros are exact), as onnxruntime's calibration does.
        lo, hi = torch.clamp(self.range_min, max=0.0), torch.clamp(self.range_max, min=0.0)
        scale = torch.clamp((hi - lo) / 255.0, min=1e-8)
        self.scale.copy_(scale)
        self.zero_point.copy_(torch.clamp(torch.round(-128 - lo / scale), -128, 127).to(torch.int32))


def fake_quant_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight rounded to int8 per output channel (axis 0), symmetric, values in [-127, 127]."""
    amax = weight.detach().abs().reshape(weight.shape[0], -1).amax(dim=1)
    scale = torch.clamp(amax / WEIGHT_QMAX, min=1e-12)
    zero = torch.zeros(weight.shape[0], dtype=torch.int32, device=weight.device)
    return torch.fake_quantize_per_channel_affine(weight, scale, zero, 0, -128, 127)


class FakeQuantConv2d(nn.Module):
    """A Conv2d whose input and weights are fake-quantized; state dict keys: conv.*, input_quant.*."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        self.conv, self.input_quant = conv, ActivationFakeQuant()

    def forward(self, x):
        c = self.conv
        return nn.functional.conv2d(self.input_quant(x), fake_quant_weight(c.weight), c.bias, c.stride, c.padding,
                                    c.dilation, c.groups)


class FakeQuantLinear(nn.Module):
    """A Linear whose input and weights are fake-quantized; state dict keys: linear.*, input_quant.*."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear, self.input_quant = linear, ActivationFakeQuant()

    def forward(self, x):
        return nn.functional.linear(self.input_quant(x), fake_quant_weight(self.linear.weight), self.linear.bias)


def insert_fake_quant(model: nn.Module) -> nn.Module:
    """model with BatchNorms folded and every Conv2d/Linear (padding_mode zeros) fake-quantized, in place."""
    fold_batchnorms(model)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Conv2d) and child.padding_mode == "zeros":
                setattr(parent, name, FakeQuantConv2d(child))
            elif isinstance(child, nn.Linear):
                setattr(parent, name, FakeQuantLinear(child))
    return model


def fold_batchnorms(model: nn.Module) -> list[str]:
    """Each BatchNorm2d whose only input is a Conv2d's output (found by torch.fx) folded into that conv
    with its running statistics and replaced by Identity; the names of the folded BatchNorms. A model fx
    cannot trace keeps its BatchNorms (they then run in float after the int8 convolution)."""
    try:
        graph = torch.fx.symbolic_trace(model).graph
    except Exception:  # data-dependent control flow: nothing folded, still correct
        return []
    modules = dict(model.named_modules())
    folded = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(modules.get(node.target), nn.BatchNorm2d):
            continue
        source = node.args[0]
        if (getattr(source, "op", None) != "call_module" or not isinstance(modules.get(source.target), nn.Conv2d)
                or len(source.users) != 1):
            continue
        conv, bn = modules[source.target], modules[node.target]
        weight, bias = torch.nn.utils.fusion.fuse_conv_bn_weights(
            conv.weight, conv.bias, bn.running_mean, bn.running_var, bn.eps, bn.weight, bn.bias)
        conv.weight, conv.bias = weight, bias
        _set(model, node.target, nn.Identity())
        folded.append(node.target)
    return folded


def _set(model: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, name, module)
