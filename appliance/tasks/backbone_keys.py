"""A classification network's weights as a segmentation model's backbone: its keys renamed.

torchvision builds its segmentation models around the classification networks' own modules:
LR-ASPP and DeepLabV3 (MobileNetV3) keep `features.N` as `backbone.N`; DeepLabV3 and FCN (ResNet-50)
keep `conv1` ... `layer4` as `backbone.*` (dilated, same shapes). Our models wrap them (DictOut,
`net.`). The classifier (`classifier.*`, `fc.*`) has no place in them: the segmentation head
starts fresh. A segmentation checkpoint's keys are the model's own and are left as they are.
"""

from __future__ import annotations

BACKBONE = "net.backbone."


def _renamed(key: str, architecture: str) -> str | None:
    if "mobilenet_v3" in architecture:
        return BACKBONE + key[len("features."):] if key.startswith("features.") else None
    if "resnet" in architecture:
        return None if key.startswith("fc.") else BACKBONE + key
    return None


def backbone_state(state: dict, own_keys, architecture: str) -> tuple[dict, dict | None]:
    """(state with a classification network's keys renamed onto the backbone, what was done) when
    most of state's keys are not the model's own; (state, None) when they are (a segmentation
    checkpoint) or when no rename fits this architecture."""
    own = set(own_keys)
    if not state or sum(k in own for k in state) * 2 >= len(state):
        return state, None
    renamed = {k: _renamed(k, architecture) for k in state}
    mapped = {new: state[k] for k, new in renamed.items() if new in own}
    if not mapped:
        return state, None
    unused = sorted(k for k, new in renamed.items() if new not in own)
    return mapped, {"backbone_mapping": f"classification weights onto {BACKBONE}* of {architecture}",
                    "backbone_keys_mapped": len(mapped), "classification_keys_not_used": unused}
