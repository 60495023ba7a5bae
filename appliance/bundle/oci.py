"""A deterministic OCI image archive (an `oci-archive:` tar of an OCI image layout), written in Python.

The building block of the appliance image: directory trees become layers (tar, gzip), a config
(entrypoint, environment, labels) and a manifest reference them by sha256, and the layout is
packed as one tar. Every byte is fixed by the inputs: entries sorted by name, mtimes set to
`epoch`, owners root, no host user or group names, gzip without a name or a time. The same trees
and config give the same manifest digest on any machine, which is what lets a site pin the image
by digest (`appliance train k8s --image REF@sha256:...`).
"""

from __future__ import annotations

import datetime as dt
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

from appliance.core.errors import DataError

MEDIA = "application/vnd.oci.image."


@dataclass(frozen=True)
class ImageConfig:
    """What the image runs and says about itself (the OCI config's `config` object)."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    env: tuple[str, ...] = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
    labels: dict = field(default_factory=dict)
    working_dir: str = "/"
    architecture: str = "amd64"


def _tar_tree(root: Path, epoch: int, at: str = "") -> bytes:
    """The tree under root as a tar with fixed metadata (a layer's uncompressed bytes), placed at
    `at` inside the image (its parent directories included) or at the image's root."""
    buffer = io.BytesIO()
    at = at.strip("/")
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        parts = at.split("/") if at else []
        for i in range(len(parts)):
            info = tarfile.TarInfo("/".join(parts[:i + 1]))
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        paths = sorted(root.rglob("*"), key=lambda p: p.relative_to(root).as_posix())
        for path in paths:
            name = path.relative_to(root).as_posix()
            info = tar.gettarinfo(str(path), arcname=f"{at}/{name}" if at else name)
            if info is None:  # a socket or a device: no place in an image layer
                raise DataError(f"{path}: neither a file, a directory nor a link; it cannot go into an image layer")
            info.mtime, info.uid, info.gid, info.uname, info.gname = epoch, 0, 0, "", ""
            info.mode = stat.S_IMODE(os.lstat(path).st_mode)
            info.pax_headers = {}
            if info.isreg():
                with open(path, "rb") as f:
                    tar.addfile(info, f)
            else:
                tar.addfile(info)
    return buffer.getvalue()


def _blob(blobs: dict, data: bytes, media_type: str) -> dict:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return {"mediaType": media_type, "digest": digest, "size": len(data)}


def _json(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class BaseLayer:
    """A layer taken as it is from another image (the site's base image)."""

    blob: bytes
    diff_id: str
    media_type: str


def read_base(archive: Path) -> tuple[list[BaseLayer], dict]:
    """The layers and the config of the first image in an OCI image archive."""
    try:
        with tarfile.open(archive) as tar:
            def blob(digest: str) -> bytes:
                return tar.extractfile(f"blobs/sha256/{digest.split(':', 1)[1]}").read()

            index = json.loads(tar.extractfile("index.json").read())
            manifest = json.loads(blob(index["manifests"][0]["digest"]))
            config = json.loads(blob(manifest["config"]["digest"]))
            layers = [BaseLayer(blob(d["digest"]), diff, d["mediaType"])
                      for d, diff in zip(manifest["layers"], config["rootfs"]["diff_ids"])]
    except (OSError, tarfile.TarError, KeyError, IndexError, TypeError, AttributeError, ValueError) as err:
        raise DataError(f"{archive}: not an OCI image archive ({type(err).__name__}: {err})") from None
    return layers, config


def write_image(out: Path, layers: list, config: ImageConfig, *, ref: str = "latest",
                epoch: int = 0, annotations: dict | None = None) -> str:
    """Write the archive to out; returns the manifest's digest (what `skopeo inspect` calls Digest).
    layers: lowest first, each a directory (the image's root), (directory, path in the image), or a BaseLayer."""
    blobs: dict[str, bytes] = {}
    descriptors, diff_ids = [], []
    for layer in layers:
        if isinstance(layer, BaseLayer):
            diff_ids.append(layer.diff_id)
            descriptors.append(_blob(blobs, layer.blob, layer.media_type))
            continue
        root, at = (layer, "") if isinstance(layer, (str, Path)) else layer
        plain = _tar_tree(Path(root), epoch, at)
        diff_ids.append("sha256:" + hashlib.sha256(plain).hexdigest())
        packed = io.BytesIO()
        with gzip.GzipFile(fileobj=packed, mode="wb", mtime=0, filename="", compresslevel=6) as gz:
            gz.write(plain)
        descriptors.append(_blob(blobs, packed.getvalue(), MEDIA + "layer.v1.tar+gzip"))
    runtime = {"Env": list(config.env), "WorkingDir": config.working_dir, "Labels": dict(config.labels)}
    if config.entrypoint:
        runtime["Entrypoint"] = list(config.entrypoint)
    if config.cmd:
        runtime["Cmd"] = list(config.cmd)
    image_config = {"architecture": config.architecture, "os": "linux", "config": runtime,
                    "rootfs": {"type": "layers", "diff_ids": diff_ids},
                    "created": "1970-01-01T00:00:00Z" if epoch == 0 else _iso(epoch)}
    manifest = {"schemaVersion": 2, "mediaType": MEDIA + "manifest.v1+json",
                "config": _blob(blobs, _json(image_config), MEDIA + "config.v1+json"), "layers": descriptors}
    if annotations:
        manifest["annotations"] = dict(annotations)
    manifest_descriptor = _blob(blobs, _json(manifest), MEDIA + "manifest.v1+json")
    index = {"schemaVersion": 2, "mediaType": MEDIA + "index.v1+json",
             "manifests": [{**manifest_descriptor, "annotations": {"org.opencontainers.image.ref.name": ref}}]}
    files = {"oci-layout": _json({"imageLayoutVersion": "1.0.0"}), "index.json": _json(index),
             **{f"blobs/sha256/{d.split(':', 1)[1]}": data for d, data in blobs.items()}}
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial")
    with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as tar:
        for directory in ("blobs", "blobs/sha256"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, epoch
            tar.addfile(info)
        for name in sorted(files):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(files[name]), 0o644, epoch
            tar.addfile(info, io.BytesIO(files[name]))
    os.replace(partial, out)
    return manifest_descriptor["digest"]


def _iso(epoch: int) -> str:
    return dt.datetime.fromtimestamp(epoch, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
