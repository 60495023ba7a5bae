"""`bundle build --weights NAME,...`: torchvision's published weight files, fetched and checked on the connected host.

Each NAME (or NAME:ENTRY, e.g. resnet50:IMAGENET1K_V2) is looked up in torchvision's own weights registry
(`get_model_weights(NAME).DEFAULT` or the named entry), which gives the file's URL; the file name embeds
the first hex digits of its sha256 (`resnet18-f37072fd.pth`), which is what torchvision itself checks
(`load_state_dict_from_url(check_hash=True)`, torch.hub's HASH_REGEX). We check the same prefix and keep
the full sha256 for the bundle's SHA256SUMS, SBOM and `weights/index.json` (appliance/assets/weights.py).

A company mirror of download.pytorch.org: `--weights-mirror URL` or $APPLIANCE_WEIGHTS_MIRROR replaces
the scheme and host of the published URL, keeping its path (URL/models/resnet18-f37072fd.pth).
"""

from __future__ import annotations

import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from appliance.core.errors import ApplianceError, ConfigError, EnvironmentProblem
from appliance.core.manifest import sha256_file
from appliance.core.progress import Progress

MIRROR_ENV = "APPLIANCE_WEIGHTS_MIRROR"
# torch.hub's HASH_REGEX (torch/hub.py), the pattern `load_state_dict_from_url(check_hash=True)` applies to
# the file name; kept equal to it by tests/bundle/test_bundle_weights.py.
HASH_REGEX = re.compile(r"-([a-f0-9]*)\.")
TIMEOUT_S = 60


class WeightsError(ApplianceError):
    """A published weight file cannot be fetched or does not match the hash torchvision publishes."""


@dataclass(frozen=True)
class PublishedWeights:
    name: str           # the model name, as in `torchvision:NAME`
    weights: str        # the enum entry, e.g. ResNet18_Weights.IMAGENET1K_V1
    url: str            # as torchvision publishes it
    hash_prefix: str    # from the file name
    num_classes: int | None

    @property
    def file(self) -> str:
        return self.url.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class FetchedWeights:
    published: PublishedWeights
    path: Path          # in the cache, verified
    sha256: str
    fetched_from: str

    def index_entry(self) -> dict:
        """This file's entry in weights/index.json (the format appliance/assets/weights.py reads)."""
        p = self.published
        entry = {"file": p.file, "sha256": self.sha256, "bytes": self.path.stat().st_size, "url": p.url,
                 "weights": p.weights, "num_classes": p.num_classes}
        if self.fetched_from != p.url:
            entry["fetched_from"] = self.fetched_from
        return entry


def parse_names(text: str) -> list[str]:
    """`resnet18,mobilenet_v2` (or repeated options joined) as a list without blanks or repeats."""
    return list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))


def resolve(spec: str) -> PublishedWeights:
    """NAME or NAME:ENTRY through torchvision's registry; one line listing what exists when it is not there."""
    try:
        from torchvision.models import get_model_weights, list_models
    except ImportError as err:
        raise EnvironmentProblem(f"--weights {spec}: torchvision is needed on the build host to look up the "
                                 f"published weights ({err})") from None
    name, _, entry = spec.partition(":")
    names = [n for n in list_models() if _has_weights(n)]
    if name not in names:
        raise ConfigError(f"--weights {spec}: torchvision has no model {name!r} with published weights "
                          f"(available: {', '.join(names)})")
    enum = get_model_weights(name)
    if entry:
        entries = [e.name for e in enum]
        if entry not in entries:
            raise ConfigError(f"--weights {spec}: {enum.__name__} has no entry {entry!r} "
                              f"(entries: {', '.join(entries)})")
        chosen = enum[entry]
    else:
        chosen = enum.DEFAULT
    url = chosen.url
    match = HASH_REGEX.search(url.rsplit("/", 1)[-1])
    if match is None or not match.group(1):
        raise WeightsError(f"--weights {spec}: {url} carries no hash in its file name, so torchvision publishes "
                           "none to check it against; it is not bundled")
    categories = chosen.meta.get("categories")
    num_classes = len(categories) if categories else chosen.meta.get("num_classes")
    return PublishedWeights(name, f"{enum.__name__}.{chosen.name}", url, match.group(1), num_classes)


def _has_weights(name: str) -> bool:
    from torchvision.models import get_model_weights

    try:
        return len(get_model_weights(name)) > 0
    except (ValueError, KeyError):
        return False


def mirror_url(url: str, mirror: str | None) -> str:
    """url with its scheme and host replaced by mirror's base (its path kept)."""
    if not mirror:
        return url
    return mirror.rstrip("/") + urllib.parse.urlsplit(url).path


def fetch(published: PublishedWeights, cache: Path, mirror: str | None) -> FetchedWeights:
    """The file in cache, downloaded unless a verified copy is there; refused when its sha256 does not
    start with the published prefix."""
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / published.file
    url = mirror_url(published.url, mirror)
    if path.is_file():
        digest = sha256_file(path)
        if digest.startswith(published.hash_prefix):
            print(f"bundle: weights {published.file} from the cache {cache} (sha256 checked)", file=sys.stderr,
                  flush=True)
            return FetchedWeights(published, path, digest, url)
        path.unlink()  # a damaged cache entry is fetched again, never trusted
    partial = cache / f".{published.file}.part-{os.getpid()}"
    try:
        try:
            request = urllib.request.Request(url, headers={"User-Agent": "appliance-bundle-build"})
            with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response, open(partial, "wb") as out:
                size = response.headers.get("Content-Length")
                with Progress(total=int(size) if size else None, desc=f"bundle: weights {published.file}",
                              unit="B", unit_scale=True) as bar:
                    while block := response.read(1 << 20):
                        out.write(block)
                        bar.update(len(block))
        except urllib.error.HTTPError as err:
            raise WeightsError(f"{url}: HTTP {err.code} {err.reason} fetching the weights of {published.name}"
                               + (f" (mirror from --weights-mirror / ${MIRROR_ENV})" if mirror else "")) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", None) or err
            raise WeightsError(f"{url}: cannot fetch the weights of {published.name} ({reason})") from None
        digest = sha256_file(partial)
        if not digest.startswith(published.hash_prefix):
            raise WeightsError(f"{url}: sha256 {digest[:16]}... does not start with {published.hash_prefix}, the "
                               f"hash torchvision publishes for {published.weights}; refusing the file")
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
    return FetchedWeights(published, path, digest, url)


def resolve_all(specs: list[str]) -> list[PublishedWeights]:
    """Every spec resolved (before any download, so a bad name costs nothing); one file per model."""
    published = [resolve(s) for s in specs]
    names = [p.name for p in published]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--weights: {twice[0]} named twice (an install holds one weight file per model)")
    return published
