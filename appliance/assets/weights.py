"""Where published pretrained weight files live on an installed appliance (contract between bundle and train).

A bundle built with `appliance bundle build --weights resnet18,...` carries `weights/` with one file per
model, exactly as torchvision publishes it (e.g. `resnet18-f37072fd.pth`), and `weights/index.json`:

    {"resnet18": {"file": "resnet18-f37072fd.pth", "sha256": "<hex>", "url": "https://download.pytorch.org/...",
                  "weights": "ResNet18_Weights.IMAGENET1K_V1", "num_classes": 1000}}

The installer puts that directory next to the release's venv (PREFIX/releases/REL/weights). Training finds
`init = "torchvision:resnet18"` through `find_weights`, which looks in $APPLIANCE_WEIGHTS_DIR first, then in the
directory next to the running venv; the file's sha256 is checked against the index before it is used.
"""

import json
from dataclasses import dataclass
from pathlib import Path

from appliance import beside_venv
from appliance.core.errors import ConfigError
from appliance.core.manifest import sha256_file

WEIGHTS_ENV = "APPLIANCE_WEIGHTS_DIR"
INDEX = "index.json"
PREFIX = "torchvision:"


@dataclass(frozen=True)
class PretrainedFile:
    name: str           # the model name, as in `torchvision:NAME`
    path: Path          # the weight file, verified
    sha256: str
    url: str            # the published URL (a mirror that served it is in the index as fetched_from)
    weights: str        # torchvision's weights enum entry, e.g. ResNet18_Weights.IMAGENET1K_V1


def weights_dirs() -> list[Path]:
    """The directories searched, in order: $APPLIANCE_WEIGHTS_DIR, then weights/ next to the running venv."""
    return beside_venv("weights", WEIGHTS_ENV)


def read_index(directory: Path) -> dict:
    path = directory / INDEX
    try:
        index = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        raise ConfigError(f"{path}: not a readable weights index ({err})") from None
    if not isinstance(index, dict):
        raise ConfigError(f"{path}: not a weights index (expected a JSON object of model names)")
    return index


def find_weights(name: str) -> PretrainedFile:
    """The verified weight file for `torchvision:NAME`; one line naming the bundle option when it is absent."""
    searched = weights_dirs()
    for directory in searched:
        entry = read_index(directory).get(name)
        if entry is None:
            continue
        path = directory / entry["file"]
        if not path.is_file():
            raise ConfigError(f"{path}: listed in {directory / INDEX} for {name} but missing")
        digest = sha256_file(path)
        if digest != entry["sha256"]:
            raise ConfigError(f"{path}: sha256 {digest[:16]}... does not match {directory / INDEX} "
                              f"({entry['sha256'][:16]}...); the file is damaged")
        return PretrainedFile(name, path, digest, entry.get("url", ""), entry.get("weights", ""))
    where = ", ".join(str(d) for d in searched)
    raise ConfigError(f"{PREFIX}{name}: no such pretrained weights in this install (looked in {where}); "
                      f"build the bundle with `appliance bundle build --weights {name}` to carry them")
