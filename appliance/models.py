"""Models by name, and the trained-model directory every later stage reads.

A trained-model directory holds `model.safetensors` (weights) and `model.json` (the
model card: architecture, classes, preprocessing). Export, quantize and the edge runner
take preprocessing from the card, so it is stated once, where training decided it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from appliance.errors import ConfigError, DataError

CARD_NAME = "model.json"
WEIGHTS_NAME = "model.safetensors"
TORCHVISION_ARCHITECTURES = ("resnet18", "resnet34", "resnet50", "mobilenet_v2", "mobilenet_v3_small",
                             "efficientnet_b0", "shufflenet_v2_x1_0")
ARCHITECTURES = ("small_cnn", *TORCHVISION_ARCHITECTURES)


@dataclass(frozen=True)
class ModelCard:
    architecture: str
    num_classes: int
    in_channels: int = 3
    image_size: int = 224
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    channel_order: str = "RGB"  # or "L" for one channel
    class_names: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "model.json") -> "ModelCard":
        try:
            raw = json.loads(text)
            raw["mean"], raw["std"] = tuple(raw["mean"]), tuple(raw["std"])
            raw["class_names"] = tuple(raw.get("class_names", ()))
            return cls(**raw)
        except (json.JSONDecodeError, TypeError, KeyError) as err:
            raise DataError(f"{source}: not a valid model card ({err})") from None


def small_cnn(num_classes: int, in_channels: int = 3):
    """A compact CNN for small images (8-64 px): three conv blocks, global pooling, a linear head."""
    from torch import nn

    def block(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))

    return nn.Sequential(
        block(in_channels, 32), block(32, 32), nn.MaxPool2d(2),
        block(32, 64), block(64, 64), nn.MaxPool2d(2),
        block(64, 128),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, num_classes),
    )


def build_model(architecture: str, num_classes: int, in_channels: int = 3):
    """A freshly initialised model (never downloads weights: the appliance is offline)."""
    if architecture == "small_cnn":
        return small_cnn(num_classes, in_channels)
    if architecture not in TORCHVISION_ARCHITECTURES:
        raise ConfigError(f"unknown model architecture {architecture!r}; choose one of {', '.join(ARCHITECTURES)}")
    import torchvision
    from torch import nn

    model = getattr(torchvision.models, architecture)(weights=None, num_classes=num_classes)
    if in_channels != 3:
        # Replace the first convolution so one-channel (or other) inputs work.
        for name, module in model.named_modules():
            if isinstance(module, nn.Conv2d):
                new = nn.Conv2d(in_channels, module.out_channels, module.kernel_size, module.stride,
                                module.padding, bias=module.bias is not None)
                parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
                setattr(parent, name.rsplit(".", 1)[-1], new)
                break
    return model


def save_trained_model(out_dir: str | Path, model, card: ModelCard) -> Path:
    """Write weights + card into out_dir (created). Atomic per file."""
    from safetensors.torch import save_file

    from appliance.manifest import atomic_write_text

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = out_dir / f".{WEIGHTS_NAME}.tmp"
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(tmp))
    tmp.replace(out_dir / WEIGHTS_NAME)
    atomic_write_text(out_dir / CARD_NAME, card.to_json())
    return out_dir


def load_trained_model(model_dir: str | Path):
    """(model in eval mode, card) from a trained-model directory. Loads no pickle."""
    from safetensors.torch import load_file

    model_dir = Path(model_dir)
    card_path, weights = model_dir / CARD_NAME, model_dir / WEIGHTS_NAME
    if not card_path.exists() or not weights.exists():
        raise DataError(f"{model_dir}: not a trained-model directory (needs {CARD_NAME} and {WEIGHTS_NAME})")
    card = ModelCard.from_json(card_path.read_text(), str(card_path))
    model = build_model(card.architecture, card.num_classes, card.in_channels)
    try:
        state = load_file(str(weights))
    except Exception as err:  # safetensors raises its own error types for damaged files
        raise DataError(f"{weights}: unreadable weights ({err})") from None
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DataError(f"{weights}: weights do not match {card.architecture} "
                        f"(missing {list(missing)[:3]}, unexpected {list(unexpected)[:3]})")
    return model.eval(), card
